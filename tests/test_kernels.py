"""Kernels and custom ops: every attention backend, the FP8 LM-head op, the ReLU² MLP and the FP8 head's fused
cross-entropy (kernels.py) against explicit float math.
Runs on the CPU in CI (reference attention, CPU _scaled_mm) and on a GPU wherever one is present."""

import math
import os

import pytest
import torch

import kernels
import train_gpt as tg

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def explicit_attention(q, k, v, doc_lengths, window, scale):
    """Query i of a document sees keys j of the same document with i - window <= j <= i."""
    out = torch.empty_like(q)
    start = 0
    for n in doc_lengths:
        for i in range(start, start + n):
            lo = max(start, i - window)
            s = torch.einsum("hd,jhd->hj", q[i], k[lo:i + 1]) * scale
            out[i] = torch.einsum("hj,jhd->hd", s.softmax(-1), v[lo:i + 1])
        start += n
    return out


@pytest.mark.parametrize("backend", kernels.available_attention_backends(DEVICE))
@pytest.mark.parametrize("window", [3, 16, 1000])
def test_attention_backend_matches_explicit_masked_computation(backend, window):
    g = torch.Generator().manual_seed(window)
    doc_lengths = [5, 1, 40, 17, 65]  # a one-token document too
    T, H, D = sum(doc_lengths), 2, 64
    q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()] + [T] * 3, dtype=torch.int32)  # padded
    expected = explicit_attention(q.double(), k.double(), v.double(), doc_lengths, window, 0.12)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    fn = tg.ATTENTION_BACKENDS[backend]
    got = fn(*(t.to(DEVICE, dtype) for t in (q, k, v)), cu.to(DEVICE), max(doc_lengths), window, 0.12)
    err = (got.double().cpu() - expected).norm() / expected.norm()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), f"{backend}: relative error {err:.2e}"


def test_fp8_head_op_forward_and_backward_match_float_reference():
    if not tg.kernels.fp8_supported(DEVICE):
        pytest.skip(f"_scaled_mm FP8 does not run on {DEVICE}")
    g = torch.Generator().manual_seed(0)
    T, dim, V = 64, 128, 256
    x = torch.nn.functional.rms_norm(torch.randn(T, dim, generator=g), (dim,)).to(DEVICE, torch.bfloat16)
    w = (0.05 * torch.randn(V, dim, generator=g)).to(DEVICE)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = torch.ops.speedrun.mm_fp8(x, w, tg.head_x_scale(dim), tg.HEAD_W_SCALE, tg.HEAD_GRAD_SCALE)[0]
    grad_out = torch.randn(T, V, generator=g).to(DEVICE, torch.bfloat16) * 1e-2
    out.backward(grad_out)
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = xr @ wr.T
    ref.backward(grad_out.double())

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    # e4m3 keeps 3 mantissa bits (~6% worst-case rounding, ~2-3% on average over a dot product);
    # e5m2 grads keep 2 bits.
    assert out.dtype == torch.bfloat16 and out.shape == (T, V)
    assert rel(out, ref) < 0.05
    assert rel(x.grad, xr.grad) < 0.1
    assert rel(w.grad, wr.grad) < 0.1
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_fp8_head_op_compiles_in_a_graph_without_breaks():
    if not tg.kernels.fp8_supported(DEVICE):
        pytest.skip(f"_scaled_mm FP8 does not run on {DEVICE}")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():  # the fake (meta) implementations give the real shapes and dtypes
        x, w = torch.empty(8, 32, dtype=torch.bfloat16), torch.empty(16, 32)
        out, x8t, w8t = torch.ops.speedrun.mm_fp8(x, w, 0.1, 0.1, 0.1)
        g8, g8t = kernels.quantize(out, 0.1, torch.float8_e5m2)
        gx, gw = torch.ops.speedrun.mm_fp8_backward(g8, g8t, x8t, w8t, 0.1, 0.1, 0.1)
    assert (out.shape, x8t.shape, w8t.shape) == ((8, 16), (32, 8), (32, 16))
    assert x8t.dtype == w8t.dtype == torch.float8_e4m3fn
    assert (gx.shape, gx.dtype, gw.shape, gw.dtype) == ((8, 32), torch.bfloat16, (16, 32), torch.float32)


@pytest.mark.slow
def test_fp8_head_compiled_with_the_loss_matches_eager():
    """Compiled, the gradient's FP8 quantization is traced into the backward graph and fused with the
    cross-entropy backward; the result must equal the eager op's up to rounding."""
    if not tg.kernels.fp8_supported(DEVICE):
        pytest.skip(f"_scaled_mm FP8 does not run on {DEVICE}")
    g = torch.Generator().manual_seed(0)
    T, dim, V = 64, 128, 256
    x0 = torch.randn(T, dim, generator=g).to(DEVICE, torch.bfloat16)
    w0 = (0.05 * torch.randn(V, dim, generator=g)).to(DEVICE)
    target = torch.randint(0, V, (T,), generator=g).to(DEVICE)

    def loss_fn(x, w):
        logits = torch.ops.speedrun.mm_fp8(x, w, tg.head_x_scale(dim), tg.HEAD_W_SCALE, tg.HEAD_GRAD_SCALE)[0]
        return torch.nn.functional.cross_entropy(30 * torch.sigmoid(logits.float() / 7.5), target)

    results = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        loss = fn(x, w)
        loss.backward()
        results.append((loss.detach(), x.grad.float(), w.grad))
    (l0, gx0, gw0), (l1, gx1, gw1) = results
    assert torch.allclose(l0, l1, rtol=1e-4)
    assert (gx1 - gx0).norm() / gx0.norm() < 0.02 and (gw1 - gw0).norm() / gw0.norm() < 0.02


def _graph_breaking(q, k, v, cu, max_seqlen, window, scale):
    torch._dynamo.graph_break()  # what fullgraph tracing cannot take (as flash-attn-4's autograd.Function)
    return tg.attention_reference(q, k, v, cu, max_seqlen, window, scale)


def _off_by_half(q, k, v, cu, max_seqlen, window, scale):
    return 1.5 * tg.attention_reference(q, k, v, cu, max_seqlen, window, scale)


@pytest.fixture
def fake_backends(monkeypatch):
    """A registry whose two fastest backends are installed but broken, the third sound."""
    for name, fn in [("breaks", _graph_breaking), ("wrong", _off_by_half), ("sound", tg.attention_reference)]:
        monkeypatch.setitem(tg.ATTENTION_BACKENDS, name, fn)
        monkeypatch.setitem(kernels.ATTENTION_INSTALL, name, f"pip install {name}")
    monkeypatch.setattr(kernels, "available_attention_backends", lambda device: ["breaks", "wrong", "sound", "reference"])


def test_auto_skips_installed_backends_that_fail_their_check_and_says_why(fake_backends):
    said = []
    assert tg.kernels.select_attention("auto", torch.device("cpu"), compiled=True, log=said.append) == "sound"
    assert len(said) == 2 and said[0].startswith("attention: skipping breaks: ") and "graph_break" in said[0].lower()
    assert said[1].startswith("attention: skipping wrong: differs from the reference path (relative error 1.")
    # traced without compile, the graph break is harmless: that backend then passes
    assert tg.kernels.select_attention("auto", torch.device("cpu"), compiled=False, log=said.append) == "breaks"


def test_a_requested_backend_that_fails_or_is_missing_is_one_error_naming_its_source(fake_backends):
    with pytest.raises(ValueError, match=r"'wrong' failed its start-up check on cpu: differs .* pip install wrong"):
        tg.kernels.select_attention("wrong", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"'fa4' is not available on cpu .*pip install -r requirements-hopper.txt"):
        tg.kernels.select_attention("fa4", torch.device("cpu"))


def test_a_gpu_run_never_falls_back_to_the_quadratic_reference_silently(fake_backends, monkeypatch):
    monkeypatch.setattr(kernels, "available_attention_backends", lambda device: ["wrong", "reference"])
    with pytest.raises(ValueError, match=r"no attention backend passed its start-up check on cuda: wrong: "):
        tg.kernels.select_attention("auto", torch.device("cuda"), log=lambda m: None)
    assert tg.kernels.select_attention("auto", torch.device("cpu"), log=lambda m: None) == "reference"  # the CPU path


# FlashAttention-3/4 are wrapped as custom-op pairs (kernels.flash_attention_op). Their kernels need a
# Hopper GPU (tests/test_attention_gpu.py); here the same wrapper carries explicit float math, which
# exercises the registration itself: fakes, autograd, and fullgraph tracing through the op.

def _explicit_forward(q, k, v, cu, max_seqlen, window, scale):
    pos = torch.arange(q.size(0))
    doc = torch.searchsorted(cu, pos, right=True)
    delta = pos[:, None] - pos[None, :]
    mask = (doc[:, None] == doc[None, :]) & (delta >= 0) & (delta <= window)
    s = torch.einsum("thd,shd->hts", q.float(), k.float()).mul(scale).masked_fill(~mask, float("-inf"))
    lse = s.logsumexp(-1)  # (H, T), as the kernels return it
    return torch.einsum("hts,shd->thd", (s - lse[..., None]).exp(), v.float()).to(q.dtype), lse


class _Untraceable(torch.autograd.Function):
    """A front end dynamo cannot trace, like flash-attn-4's FlashAttnVarlenFunc."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen, window, scale):
        torch._dynamo.graph_break()
        return _explicit_forward(q, k, v, cu, max_seqlen, window, scale)[0]


def _explicit_backward(grad_out, q, k, v, out, lse, cu, max_seqlen, window, scale):
    """The flash-attention backward from the saved output and log-sum-exp, written out."""
    dtype = q.dtype
    grad_out, q, k, v, out = (t.float() for t in (grad_out, q, k, v, out))
    pos = torch.arange(q.size(0))
    doc = torch.searchsorted(cu, pos, right=True)
    delta = pos[:, None] - pos[None, :]
    mask = (doc[:, None] == doc[None, :]) & (delta >= 0) & (delta <= window)
    s = torch.einsum("thd,shd->hts", q, k) * scale
    p = (s - lse[..., None]).exp() * mask  # (H, T, T) attention probabilities
    dp = torch.einsum("thd,shd->hts", grad_out, v)
    ds = p * (dp - (grad_out * out).sum(-1).T[..., None])
    grads = (torch.einsum("hts,shd->thd", ds, k) * scale, torch.einsum("hts,thd->shd", ds, q) * scale,
             torch.einsum("hts,thd->shd", p, grad_out))
    return tuple(g.to(dtype) for g in grads)


def _untraceable_forward(q, k, v, cu, max_seqlen, window, scale):
    out = _Untraceable.apply(q, k, v, cu, max_seqlen, window, scale)
    return out, _explicit_forward(q, k, v, cu, max_seqlen, window, scale)[1]


WRAPPED = kernels.flash_attention_op("test_wrapped", _untraceable_forward, _explicit_backward)


def _attention_inputs(seed=0, T=96, H=2, D=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, H, D, generator=g, requires_grad=True) for _ in range(3))
    return q, k, v, torch.tensor([0, 30, 31, T, T, T], dtype=torch.int32)  # a one-token document, padding


def test_flash_attention_op_has_consistent_schema_fake_and_autograd():
    q, k, v, cu = _attention_inputs()
    torch.library.opcheck(torch.ops.speedrun.test_wrapped, (q, k, v, cu, 65, 7, 0.25))
    torch.library.opcheck(torch.ops.speedrun.test_wrapped_backward,
                          (torch.randn(96, 2, 16), *(t.detach() for t in (q, k, v)), torch.randn(96, 2, 16),
                           torch.randn(2, 96), cu, 65, 7, 0.25))


def test_flash_attention_op_traces_fullgraph_and_matches_the_reference_in_value_and_gradient():
    q, k, v, cu = _attention_inputs(1)
    with pytest.raises(Exception, match="graph_break"):  # the raw front end breaks fullgraph tracing
        torch.compile(lambda *a: _Untraceable.apply(*a), fullgraph=True, backend="aot_eager")(q, k, v, cu, 65, 7, 0.25)
    compiled = torch.compile(WRAPPED, fullgraph=True, dynamic=False, backend="aot_eager")
    got = compiled(q, k, v, cu, 65, 7, 0.25)
    got.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = tg.attention_reference(q, k, v, cu, 65, 7, 0.25)
    ref.square().sum().backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-5)


def test_auto_picks_a_wrapped_backend_whose_raw_front_end_breaks_compilation(monkeypatch):
    monkeypatch.setitem(tg.ATTENTION_BACKENDS, "raw", lambda *a: _Untraceable.apply(*a))
    monkeypatch.setitem(tg.ATTENTION_BACKENDS, "wrapped", WRAPPED)
    monkeypatch.setitem(kernels.ATTENTION_INSTALL, "raw", "pip install raw")
    monkeypatch.setattr(kernels, "available_attention_backends", lambda device: ["raw", "wrapped", "reference"])
    said = []
    assert tg.kernels.select_attention("auto", torch.device("cpu"), compiled=True, log=said.append) == "wrapped"
    assert len(said) == 1 and said[0].startswith("attention: skipping raw: ")


@pytest.mark.parametrize("name", ["fa3", "fa4"])
def test_the_real_flash_backends_trace_with_fake_tensors_through_forward_and_backward(name):
    with torch._subclasses.FakeTensorMode():  # shapes come from the registered fakes, no kernel runs
        q, k, v = (torch.empty(256, 6, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out, lse = getattr(torch.ops.speedrun, name)(q, k, v, torch.zeros(5, dtype=torch.int32), 256, 384, 0.12)
        out.sum().backward()  # through register_autograd into the fake of the backward op
    assert out.shape == q.shape and lse.shape == (6, 256) and lse.dtype == torch.float32
    assert all(t.grad is not None and t.grad.shape == q.shape for t in (q, k, v))


# kernels.py (the ReLU² MLP): the Triton kernels in Triton's CPU interpreter and compiled for an H100,
# the PyTorch reference the op runs on the CPU, the model's fused path against its unfused one, and the
# kernels on a GPU.

INTERPRETER_SCRIPT = """
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import kernels, test_kernels as t
assert kernels.triton_runs_on(torch.zeros(1)), "the Triton interpreter is not in use"
kernels.RELU2_TMA_INTERPRET = sys.argv[3:] == ["tma"]
kernels.RELU2_TILES = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2)  # 50 x 40 x 72: edge tiles masked
size = dict(dim=48, hidden=80) if kernels.RELU2_TMA_INTERPRET else {}  # TMA: rows of 16-byte multiples
# the kernel that ran each call: both kinds must have run where the test says so
calls = []
for name in ("_matmul_relu2_kernel", "_matmul_relu2_tma_kernel"):
    launcher = getattr(kernels, name)
    class Spy:
        def __getitem__(self, grid, launcher=launcher, name=name):
            calls.append(name)
            return launcher[grid]
    setattr(kernels, name, Spy())
errors = t.check_relu2_mlp_op(*t.relu2_mlp_case(torch.float32, **size))
print(json.dumps(errors + [sorted(set(calls))]))
"""


def run_in_triton_interpreter(script_text: str, tmp_path, *extra: str):
    """Run a check script in a fresh process with TRITON_INTERPRET=1 (it must be set before triton is first
    imported); the script gets the project's and the tests' folders as arguments (then `extra`) and prints
    JSON last."""
    return interpreter_result(start_in_triton_interpreter(script_text, tmp_path, *extra))


def start_in_triton_interpreter(script_text: str, tmp_path, *extra: str):
    """run_in_triton_interpreter's process, started and left running: its output goes to files in tmp_path."""
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "interpret.py"
    script.write_text(script_text)
    root, here = Path(tg.__file__).parent, Path(__file__).parent
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, str(script), str(root), str(here), *extra], stdout=out, stderr=err,
                                text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    return proc, tmp_path


def interpreter_result(started):
    """Waits for a started process; its JSON."""
    import json
    proc, tmp_path = started
    proc.wait(timeout=600)
    assert proc.returncode == 0, (tmp_path / "stderr").read_text()[-3000:]
    return json.loads((tmp_path / "stdout").read_text().strip().splitlines()[-1])


INTERPRETER_BATCH = """
import contextlib, io, json, sys
results = []
for path in sys.argv[3:]:  # each script as if run alone, its JSON kept
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__"})
    results.append(json.loads(out.getvalue().strip().splitlines()[-1]))
print(json.dumps(results))
"""


INTERPRETED = ("test_copy_pointer_kernels_match_the_reference_and_the_written_out_pointer_in_the_interpreter",
               "test_fp8_mlp_backward_in_the_interpreter_matches_float32_arithmetic_on_its_fp8_operands")


@pytest.fixture(scope="module", autouse=True)
def interpreter_checks_started(request, tmp_path_factory):
    """The quick set's two interpreter checks, the copy pointer's and the FP8 MLP backward's (it sets kernels'
    globals: last), in one fresh process: its imports (torch, dynamo, kernels, ~7 s of a 2-core CPU) once. Started
    at this file's first test where the checks are to run, so that a second core runs it (~11 s) beside the ~9 s of
    tests before the first of them; None where they are not."""
    if torch.cuda.is_available() or not {item.name for item in request.session.items} & set(INTERPRETED):
        yield None
        return
    tmp = tmp_path_factory.mktemp("interpreted")
    names = {"pointer": POINTER_SCRIPT, "fp8_backward": FP8_BACKWARD_SCRIPT}
    for name, text in names.items():
        (tmp / f"{name}.py").write_text(text)
    started = start_in_triton_interpreter(INTERPRETER_BATCH, tmp, *(str(tmp / f"{name}.py") for name in names))
    yield names, started
    if started[0].poll() is None:  # its tests did not run to the end (-x, Ctrl-C)
        started[0].kill()
        started[0].wait()


@pytest.fixture(scope="module")
def interpreted(interpreter_checks_started):
    names, started = interpreter_checks_started
    return dict(zip(names, interpreter_result(started)))


# On a CUDA machine the GPU test below runs the compiled kernels instead. (On the H100 with PyTorch 2.11 this
# interpreter run failed inside Triton: "TypeError: only 0-dimensional arrays can be converted to Python scalars".)
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machines' check; the GPU test covers the compiled kernels")
@pytest.mark.parametrize("kernel", ["pointers", "tma"])  # _matmul_relu2_kernel; Hopper's _matmul_relu2_tma_kernel
def test_triton_kernels_match_float64_autograd_in_the_triton_interpreter(tmp_path, kernel):
    *errors, ran = run_in_triton_interpreter(INTERPRETER_SCRIPT, tmp_path, kernel)
    assert ran == ["_matmul_relu2_tma_kernel" if kernel == "tma" else "_matmul_relu2_kernel"], ran
    # float32 only: the interpreter of Triton 3.9 multiplies bf16 tiles wrongly (a plain tl.dot too); the
    # GPU test below covers bf16. (The FP8 op's interpreter check is FP8_BACKWARD_SCRIPT's.)
    assert len(errors) == 4 and max(errors) < 1e-5, errors


def relu2_mlp_case(dtype, T=50, dim=40, hidden=72, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, dim, generator=g).to(dtype), (0.2 * torch.randn(dim, hidden, generator=g)).to(dtype),
            (0.2 * torch.randn(dim, hidden, generator=g)).to(dtype))


def check_relu2_mlp_op(x, fc_w, proj_w):
    """Relative errors of the op's output and its three gradients against float64 autograd."""
    import kernels
    ref_in = [t.double().requires_grad_(True) for t in (x, fc_w, proj_w)]
    expected = kernels.relu2_mlp_reference(*ref_in)
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(x.device)
    (expected * grad_out).sum().backward()
    got_in = [t.clone().requires_grad_(True) for t in (x, fc_w, proj_w)]
    out = torch.ops.speedrun.relu2_mlp(*got_in)[0]
    (out * grad_out.to(out.dtype)).sum().backward()
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    assert out.dtype == x.dtype and all(g.grad.dtype == x.dtype for g in got_in)
    return [rel(out, expected.detach())] + [rel(g.grad, r.grad) for g, r in zip(got_in, ref_in)]


def relu2_mlp_fp8_inputs(x, fc_w, proj_w):
    """The FP8 op's inputs as the model makes them (train_gpt.fp8_mlp_operands), x RMS-normed first: (x, x_f8,
    x_f8_t, fc_w, fc_f8, fc_f8_t, proj_w, proj_f8, proj_f8_t, scales, parts)."""
    x = torch.nn.functional.rms_norm(x, (x.size(-1),))
    return (x, *tg.fp8_mlp_operands(x, fc_w, proj_w))


def check_relu2_mlp_fp8_op(x, fc_w, proj_w):
    """The FP8 op (forward and backward in FP8; the kernels where Hopper's kernel runs) against the float32
    references on the same FP8 operands, then against the unquantized MLP in float64: relative errors [out vs
    relu2_mlp_fp8_reference, grad x / fc_w / proj_w vs relu2_mlp_fp8_backward_reference, out vs float64,
    grad x / fc_w / proj_w vs float64]."""
    import kernels
    x, x_f8, x_f8_t, _, fc_f8, fc_f8_t, _, proj_f8, proj_f8_t, scales, parts = relu2_mlp_fp8_inputs(x, fc_w, proj_w)
    emulated, post, post_f8 = kernels.relu2_mlp_fp8_reference(x_f8, fc_f8_t, proj_f8, scales, x.dtype)
    ref_in = [t.detach().double().requires_grad_(True) for t in (x, fc_w, proj_w)]
    expected = kernels.relu2_mlp_reference(*ref_in)
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(x.device)
    (expected * grad_out).sum().backward()
    emulated_grads = kernels.relu2_mlp_fp8_backward_reference(
        grad_out.to(x.dtype), x_f8_t, parts[0, :1], fc_f8, parts[1, :1], proj_f8_t, scales[1, :1], parts[2, :1], post_f8,
        scales[2, :1], post.float().amax().reshape(1))[:3]
    got_in = [t.detach().clone().requires_grad_(True) for t in (x, fc_w, proj_w)]
    out, _, _, _ = torch.ops.speedrun.relu2_mlp_all_fp8(got_in[0], x_f8, x_f8_t, got_in[1], fc_f8, fc_f8_t, got_in[2],
                                                     proj_f8, proj_f8_t, scales, parts)
    (out * grad_out.to(out.dtype)).sum().backward()
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
    assert out.dtype == x.dtype and all(g.grad.dtype == g.dtype for g in got_in)
    return ([rel(out, emulated)] + [rel(g.grad, e) for g, e in zip(got_in, emulated_grads)]
            + [rel(out, expected.detach())] + [rel(g.grad, r.grad) for g, r in zip(got_in, ref_in)])


def test_fp8_mlp_reference_path_is_its_emulation_and_close_to_the_unquantized_mlp():
    errors = check_relu2_mlp_fp8_op(*relu2_mlp_case(torch.float32, dim=48, hidden=96))
    assert max(errors[:4]) < 1e-6, errors  # on the CPU the op is the float32 references
    # e4m3 operands, post and grad_pre (at a bound's scale): a few percent, no more (and not zero: it quantized)
    assert max(errors[4:]) < 0.15 and min(errors[4:]) > 1e-3, errors


def test_fp8_mlp_scales_keep_post_below_saturation_where_x_points_along_a_column():
    """The bound on post is reached where a token's x is parallel to a column of W_fc: there post =
    dim * |w_j|², which must still fit e4m3 (<= 448) after scaling, and come out exact to FP8 rounding."""
    import kernels
    x, fc_w, proj_w = relu2_mlp_case(torch.float32)
    j = fc_w.square().sum(0).argmax()
    x[0] = fc_w[:, j] / fc_w[:, j].norm() * math.sqrt(x.size(1))  # RMS norm leaves it as it is
    x, x_f8, _, _, _, fc_f8_t, _, proj_f8, _, scales, _ = relu2_mlp_fp8_inputs(x, fc_w, proj_w)
    _, post, post_f8 = kernels.relu2_mlp_fp8_reference(x_f8, fc_f8_t, proj_f8, scales, x.dtype)
    peak = x.size(1) * fc_w[:, j].square().sum()
    assert post[0, j] / peak == pytest.approx(1.0, rel=0.15)
    assert post.max() / scales[2, 0] <= 448 and post_f8.float().max() < 448  # no saturation
    assert post_f8.float().max() > 448 / 1.3 / 1.2  # and the range is used


def test_fp8_mlp_scales_given_to_scaled_mm_are_16_byte_aligned():
    """cuBLASLt under CUDA 13 refuses FP8 scales that are not 16-byte aligned (an H100 said
    CUBLAS_STATUS_NOT_SUPPORTED for views 4 and 8 bytes into one tensor): the op passes rows of the scales."""
    import kernels
    for rows in relu2_mlp_fp8_inputs(*relu2_mlp_case(torch.float32))[-2:]:  # scales, parts
        assert rows.shape == (3, kernels.FP8_SCALE_ROW) and rows.is_contiguous()
        assert all((rows[i, :1].data_ptr() - rows.data_ptr()) % 16 == 0 for i in range(3))
        assert torch.equal(rows, rows[:, :1].expand(3, kernels.FP8_SCALE_ROW))  # each row holds one scale


# 0: mlp_ratio 4 x model_dim 64; 176 = 2.75 x 64 = 11 x 16, not 4x (as ANVIL2's --mlp_hidden 2816 = 11 x 256 at 768)
@pytest.mark.parametrize("width", [0, 176])
def test_model_with_fp8_mlp_is_close_to_the_unfused_one_in_training_only(width):
    """--fp8_mlp in a tiny model (the CPU runs the op's float32 references): the loss within 2%, every gradient
    within FP8's percent, and evaluation untouched; at 4 x model_dim and at a width that is not."""
    from test_mtp import two_documents, W3
    models, losses = unfused_and(width, fp8=True)
    assert losses[1].item() != losses[0].item()
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=0)
    for name, error in grad_errors(models):  # e4m3 operands and grad_pre at dim 64 (3 mantissa bits)
        # the blocks' weights within FP8's percent; the MUDD gates' small biases, downstream of every block, can
        # move by more (2.4x their norm in one test order), so they count in the whole gradient's error below; so
        # does block 1's value-embedding gate at width 176 (0.35; its gradient 1/500 of an MLP matrix's, whose own
        # errors there are 0.10-0.16, as at 4x)
        assert error < 0.3 or name.startswith("mudd_gate") or (width and name.endswith("ve_gate_w")), name
    whole = [torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None]) for m in models]
    assert ((whole[1] - whole[0]).norm() / whole[0].norm()).item() < 0.3
    x, y, cu = two_documents()
    with torch.no_grad():
        evals = [m.eval()(x, y, cu, 24, W3) for m in models]
    assert evals[1].item() == evals[0].item()  # evaluation stays in bf16/float


def test_fp8_mlp_traces_fullgraph_and_matches_eager():
    x, fc_w, proj_w = relu2_mlp_case(torch.float32, dim=48, hidden=96)

    def f(x, fc_w, proj_w):
        x = torch.nn.functional.rms_norm(x, (x.size(-1),))
        return torch.ops.speedrun.relu2_mlp_all_fp8(x, *tg.fp8_mlp_operands(x, fc_w, proj_w))[0].square().sum()

    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        inputs = [t.clone().requires_grad_(True) for t in (x, fc_w, proj_w)]
        fn(*inputs).backward()
        results.append([t.grad for t in inputs])
    torch.testing.assert_close(results[1], results[0])


def unfused_and(width=0, **mlp_flags):
    """Two tiny models of the same weights, the second with these MLP flags (fused, fp8) on, and their
    training losses on one batch, backpropagated; the MLP's hidden width mlp_hidden (0: 4 x model_dim)."""
    from test_mtp import tiny_model, two_documents, W3
    # the copy feature (doc_copy) off: the comparison is of the MLP; with it on, its randomized tables move every
    # later weight's draw, and two small gradients downstream of every block (the smear gate's, the scalars') then
    # differ by 0.31 and 0.34 (over the 0.3 below)
    models = [tiny_model(mlp_hidden=width, doc_copy=False), tiny_model(mlp_hidden=width, doc_copy=False)]
    assert all(b.mlp.fc_w.size(1) == (width or 4 * b.mlp.fc_w.size(0)) for m in models for b in m.blocks)
    for block in models[1].blocks:
        for flag, value in mlp_flags.items():
            setattr(block.mlp, flag, value)
    x, y, cu = two_documents()
    losses = [m(x, y, cu, 24, W3) for m in models]
    for loss in losses:
        loss.backward()
    return models, losses


def grad_errors(models):
    """(name, relative error of the second model's gradient) for each parameter with a nonzero gradient."""
    return [(name, ((b.grad.float() - a.grad.float()).norm() / a.grad.float().norm()).item())
            for (name, a), b in zip(models[0].named_parameters(), models[1].parameters())
            if a.grad is not None and a.grad.norm() > 0]


def test_triton_kernels_compile_for_an_h100_without_one():
    """The interpreter runs Python, not Triton's compiler: compile the kernel, forward and backward, for sm_90
    down to a cubin (no GPU needed) with the record's tiles, to catch what only the compiler rejects."""
    import kernels
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = kernels._matmul_relu2_kernel
    for backward in (False, True):
        tiles = {k: v for k, v in kernels.RELU2_TILES.items() if k.isupper()}
        options = {k: v for k, v in kernels.RELU2_TILES.items() if not k.isupper()}  # num_warps, num_stages
        constexprs = {"BACKWARD": backward, **tiles}
        signature = {n: "constexpr" if n in constexprs else "*bf16" if n.endswith("_ptr") else "i32"
                     for n in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        assert len(compiled.asm["cubin"]) > 1000, f"backward={backward}"


def test_hopper_tma_kernel_compiles_for_an_h100_without_one():
    """_matmul_relu2_tma_kernel for sm_90 with the record's tiles (forward, backward, and the FP8 forward with
    W_fc as (N, K)), down to PTX and a cubin: TMA loads and stores (cp.async.bulk.tensor), wgmma, and shared
    memory for the operand pipeline and the half-tile epilogue within RELU2_TMA_SHARED_MEMORY (an H100 has 227 KiB)."""
    import kernels
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = kernels._matmul_relu2_tma_kernel
    # (backward, fp8): the bf16 forward and backward, the FP8 forward writing its e4m3 post both ways, the FP8
    # backward (e4m3 gradient x e4m3 W_proj, e4m3 post read) writing e4m3 both ways
    for backward, fp8 in ((False, False), (True, False), (False, True), (True, True)):
        all_tiles = kernels.relu2_tiles(fp8, backward)
        tiles = {k: v for k, v in all_tiles.items() if k.isupper() and k != "PER_SM"}
        BM, BN, BK = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
        b_nk = fp8  # FP8 reads B K-major: the forward's W_fc and the FP8 backward's W_proj as (N, K)
        a = "fp8e4nv" if fp8 else "bf16"  # the FP8 backward: g in e4m3
        out = "fp8e4nv" if fp8 and backward else "bf16"
        signature = dict(a_desc=f"tensordesc<{a}[{BM},{BK}]>",
                         b_desc=(f"tensordesc<fp8e4nv[{BN},{BK}]>" if b_nk else
                                 f"tensordesc<{'fp8e4nv' if fp8 else 'bf16'}[{BK},{BN}]>"),
                         out_desc=f"tensordesc<{out}[{BM},{BN // 2}]>",
                         side_desc=f"tensordesc<{'fp8e4nv' if fp8 else 'bf16'}[{BM},{BN // 2}]>",
                         side_t_desc=(f"tensordesc<{out if backward else 'fp8e4nv'}[{BN // 2},{BM}]>" if fp8
                                      else f"tensordesc<{out}[{BM},{BN // 2}]>"),
                         scale_ptr="*fp32" if fp8 else "*bf16", amax_ptr="*fp32" if fp8 else "*bf16",
                         M="i32", N="i32", K="i32")
        q_max = 448.0
        constexprs = {"BACKWARD": backward, "FP8": fp8, "B_NK": b_nk, "Q_MAX": q_max, "NUM_SMS": 132, "STORE_T": True,
                      **tiles}
        signature.update({n: "constexpr" for n in constexprs})
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={k: v for k, v in all_tiles.items() if not k.isupper()})
        case = (backward, fp8)
        assert "cp.async.bulk.tensor" in compiled.asm["ptx"] and "wgmma" in compiled.asm["ptx"], case
        assert len(compiled.asm["cubin"]) > 1000, case
        assert compiled.metadata.shared <= kernels.RELU2_TMA_SHARED_MEMORY, (case, compiled.metadata.shared)
        # PER_SM programs side by side on one SM: 228 KiB of shared memory an SM, 1 KiB of it reserved a program
        per_sm = all_tiles.get("PER_SM", 1)
        assert per_sm * (compiled.metadata.shared + 1024) <= 228 * 1024, (case, per_sm, compiled.metadata.shared)


FP8_BACKWARD_SCRIPT = """
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import kernels
assert kernels.triton_runs_on(torch.zeros(1)), "the Triton interpreter is not in use"
kernels.RELU2_TMA_INTERPRET = True
kernels.RELU2_FP8_TILES = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
# the backward at two programs an SM (PER_SM): twice the programs, each taking every 8th tile
kernels.RELU2_FP8_BACKWARD_TILES = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, PER_SM=2)
T, dim, hidden = 80, 48, 96  # FP8 rows of 16-byte multiples (TMA), both ways; edge tiles in T
g = torch.Generator().manual_seed(0)
x = torch.nn.functional.rms_norm(torch.randn(T, dim, generator=g), (dim,))
fc_w, proj_w = torch.randn(dim, hidden, generator=g) * dim ** -0.5, torch.randn(dim, hidden, generator=g) * hidden ** -0.5
grad = torch.randn(T, dim, generator=g) * 1e-3
s = lambda t, top: (t.abs().max() / top).reshape(1)
x_s, fc_s, proj_s = s(x, 448.0), s(fc_w, 448.0), s(proj_w, 448.0)
x_f8, fc_f8, proj_f8 = ((t / sc).to(torch.float8_e4m3fn) for t, sc in ((x, x_s), (fc_w, fc_s), (proj_w, proj_s)))
post_ref = torch.relu((x_f8.float() @ fc_f8.float()) * x_s * fc_s).square()
post_s = s(post_ref, 448.0 / 1.25)
scales = torch.zeros(3, kernels.FP8_SCALE_ROW)
scales[0, 0], scales[1, 0], scales[2, 0] = x_s * fc_s, proj_s, post_s
# the forward with its e4m3 post transposed too, and post's largest value (a slot a program: 4 here)
post, post_f8, post_f8_t, slots = kernels._matmul_relu2(x_f8, fc_f8.T.contiguous().T, None, torch.float32, scales)
post_amax = slots.amax().reshape(1)
same_t = bool(torch.equal(post_f8_t.view(torch.uint8), post_f8.view(torch.uint8).T)) and slots.numel() == 4
same_t &= abs(post_amax.item() / post_ref.max().item() - 1) < 1e-5
col = proj_w.norm(dim=0).max().reshape(1)
proj_f8_t = proj_f8.T.contiguous()
ref = kernels.relu2_mlp_fp8_backward_reference(grad, x_f8.T.contiguous(), x_s, fc_f8, fc_s, proj_f8_t, proj_s, col,
                                               post_f8, post_s, post_amax)
*got, slots = kernels.relu2_mlp_fp8_backward(grad, x_f8.T.contiguous(), x_s, fc_f8, fc_s, proj_f8_t, proj_s, col,
                                             post_f8, post_f8_t, post_s, post_amax)
amax = slots.amax()
same_t &= slots.numel() == 8  # a slot a program: 4 SMs x PER_SM 2
errors = [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref[:3])]
# the model's op (relu2_mlp_all_fp8, autograd included) through the kernels
import test_kernels as t
op_errors = t.check_relu2_mlp_fp8_op(*t.relu2_mlp_case(torch.float32, T=T, dim=dim, hidden=hidden))
# and at a hidden width neither 4 x dim nor a multiple of BLOCK_N (80 = 2.5 x 32, 5 x 16: edge tiles in N), as
# ANVIL2's 2816 is not 4 x 768 (--mlp_hidden)
width_errors = t.check_relu2_mlp_fp8_op(*t.relu2_mlp_case(torch.float32, T=T, dim=dim, hidden=80))
print(json.dumps([same_t, (amax / ref[3].abs().max()).item(), *errors, *op_errors, *width_errors]))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machines' check (Triton 3.6's interpreter fails in the "
                    "persistent loop on the H100, as above); the GPU test below covers the compiled kernel")
def test_fp8_mlp_backward_in_the_interpreter_matches_float32_arithmetic_on_its_fp8_operands(interpreted):
    """kernels.relu2_mlp_fp8_backward through Hopper's kernel in Triton's interpreter: the forward's transposed e4m3
    post is its post, transposed, byte for byte, and post's largest value is taken; so is grad_pre's, with two
    programs an SM (RELU2_FP8_BACKWARD_TILES' PER_SM, a slot each); the three gradients match float32
    arithmetic on the same FP8 operands (relu2_mlp_fp8_backward_reference); the op at hidden 96 and at 80, a width
    that is not 4 x dim and leaves edge tiles in N (--mlp_hidden), the same."""
    same_t, amax_ratio, *errors = interpreted["fp8_backward"]
    assert same_t and abs(amax_ratio - 1) < 1e-5, (same_t, amax_ratio)
    assert len(errors) == 3 + 8 + 8 and max(errors[:3]) < 2e-2, errors
    for op in (errors[3:11], errors[11:]):  # the op: its emulation, then float64
        assert max(op[:4]) < 2e-2 and max(op[4:]) < 0.15, errors


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the FP8 backward runs in Hopper's TMA kernel")
def test_fp8_mlp_backward_on_the_gpu_matches_float32_arithmetic_on_its_fp8_operands():
    T, dim, hidden = 1024, 768, 3072
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.nn.functional.rms_norm(torch.randn(T, dim, device="cuda", generator=g), (dim,))
    fc_w = torch.randn(dim, hidden, device="cuda", generator=g) * dim ** -0.5
    proj_w = torch.randn(dim, hidden, device="cuda", generator=g) * hidden ** -0.5
    grad = (torch.randn(T, dim, device="cuda", generator=g) * 1e-3).bfloat16()
    s = lambda t, top: (t.abs().max() / top).reshape(1)
    x_s, fc_s, proj_s = s(x, 448.0), s(fc_w, 448.0), s(proj_w, 448.0)
    x_f8, fc_f8, proj_f8 = ((t / sc).to(torch.float8_e4m3fn) for t, sc in ((x, x_s), (fc_w, fc_s), (proj_w, proj_s)))
    post_s = s(torch.relu((x_f8.float() @ fc_f8.float()) * x_s * fc_s).square(), 448.0 / 1.25)
    scales = torch.zeros(3, kernels.FP8_SCALE_ROW, device="cuda")
    scales[0, 0], scales[1, 0], scales[2, 0] = (x_s * fc_s)[0], proj_s[0], post_s[0]
    _, post_f8, post_f8_t, slots = kernels._matmul_relu2(x_f8, fc_f8.T.contiguous().T, None, torch.bfloat16, scales)
    assert torch.equal(post_f8_t.view(torch.uint8), post_f8.view(torch.uint8).T)
    post_amax = slots.amax().reshape(1)
    col = proj_w.norm(dim=0).max().reshape(1)
    proj_f8_t = proj_f8.T.contiguous()
    ref = kernels.relu2_mlp_fp8_backward_reference(grad, x_f8.T.contiguous(), x_s, fc_f8, fc_s, proj_f8_t, proj_s,
                                                   col, post_f8, post_s, post_amax)
    *got, slots = kernels.relu2_mlp_fp8_backward(grad, x_f8.T.contiguous(), x_s, fc_f8, fc_s, proj_f8_t, proj_s, col,
                                                 post_f8, post_f8_t, post_s, post_amax)
    assert abs(slots.amax().item() / ref[3].abs().max().item() - 1) < 1e-3
    for a, b in zip(got, ref[:3]):  # FP8 matmuls accumulate in float32 too: rounding of the sums only
        assert ((a.float() - b).abs().max() / b.abs().max()).item() < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_relu2_mlp_reference_path_matches_float64_autograd(dtype):
    assert max(check_relu2_mlp_op(*relu2_mlp_case(dtype))) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


# 0: mlp_ratio 4 x model_dim 64; 176 = 2.75 x 64 = 11 x 16, not 4x (as ANVIL2's --mlp_hidden 2816 = 11 x 256 at 768)
@pytest.mark.parametrize("width", [0, 176])
def test_model_with_fused_mlp_gives_the_unfused_losses_and_gradients(width):
    models, losses = unfused_and(width, fused=True)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for name, error in grad_errors(models):
        assert error < 1e-2, name


def test_relu2_mlp_traces_fullgraph_and_matches_eager():
    x, fc_w, proj_w = relu2_mlp_case(torch.float32)

    def f(x, fc_w, proj_w):
        return torch.ops.speedrun.relu2_mlp(x, fc_w, proj_w)[0].square().sum()

    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        inputs = [t.clone().requires_grad_(True) for t in (x, fc_w, proj_w)]
        fn(*inputs).backward()
        results.append([t.grad for t in inputs])
    torch.testing.assert_close(results[1], results[0])


def use_kernel(kernel: str, monkeypatch):
    """Make the fused MLP take the pointer kernel where the TMA one would run (for "pointers"); check that
    the TMA one runs here (for "tma": Hopper GPUs) or skip."""
    import kernels
    if kernel == "pointers":
        monkeypatch.setattr(kernels, "relu2_tma_programs", lambda device: 0)
    elif not kernels.relu2_tma_programs(torch.device("cuda")):
        pytest.skip("_matmul_relu2_tma_kernel runs on sm_90+ GPUs only")
    else:  # and the TMA kernel is the one that runs (its layout checks fall back to the pointer kernel)
        class Refuse:
            def __getitem__(self, grid):
                raise AssertionError("_matmul_relu2_kernel ran where _matmul_relu2_tma_kernel should")
        monkeypatch.setattr(kernels, "_matmul_relu2_kernel", Refuse())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("kernel", ["pointers", "tma"])
def test_relu2_mlp_kernels_on_the_gpu_at_the_record_shapes(kernel, monkeypatch):
    use_kernel(kernel, monkeypatch)
    errors = check_relu2_mlp_op(*(t.cuda() for t in relu2_mlp_case(torch.bfloat16, T=4096 + 17, dim=768, hidden=3072)))
    assert max(errors) < 1e-2, errors


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the FP8 MLP runs in Hopper's TMA kernel (sm90+)")
@pytest.mark.parametrize("T", [4096, 4096 + 16])
def test_fp8_mlp_kernels_on_the_gpu_at_the_record_shapes(T, monkeypatch):
    use_kernel("tma", monkeypatch)
    errors = check_relu2_mlp_fp8_op(*(t.cuda() for t in relu2_mlp_case(torch.bfloat16, T=T, dim=768, hidden=3072)))
    # against the float32 references on the same FP8 operands: the tensor cores' accumulation and _scaled_mm's
    # fast accumulation in the forward, a post a rounding away from an e4m3 boundary landing on the other side;
    # against the unquantized MLP, e4m3's few percent: a wrong scale or layout would be off by order 1
    assert max(errors[:4]) < 2e-2 and max(errors[4:]) < 0.15, errors


def test_fused_mlp_fits_by_the_gpus_shared_memory(monkeypatch):
    import kernels
    need = kernels.relu2_tiles_shared_memory()
    tiles = dict(kernels.RELU2_TILES, num_stages=2)
    assert kernels.relu2_tiles_shared_memory(tiles) == need * 2 // 3  # one pipeline stage less, a third less
    cuda = torch.device("cuda", 0)
    if kernels.triton is not None:
        for smem, fits in [(need - 1, False), (need, True), (227 * 1024, True), (99 * 1024, False)]:
            monkeypatch.setattr(kernels, "max_shared_memory", lambda device, smem=smem: smem)
            assert kernels.relu2_mlp_fits(cuda) is fits, smem
    assert kernels.relu2_mlp_fits(torch.device("cpu"))  # the op's reference path runs anywhere


def test_build_runs_the_mlp_unfused_where_the_kernel_does_not_fit(tiny_args, monkeypatch):
    import kernels
    args = tiny_args(fused_mlp=True, compile=False)
    model = tg.build(args, torch.device("cpu"), 0, 1)[0]
    assert all(b.mlp.fused for b in model.blocks)
    assert "MLP: fused" in tg.run_report(model, args, torch.device("cpu"), 1)[0]
    monkeypatch.setattr(kernels, "relu2_mlp_fits", lambda device: False)
    monkeypatch.setattr(kernels, "max_shared_memory", lambda device: 99 * 1024)
    lines = []
    model = tg.build(args, torch.device("cpu"), 0, 1, log=lines.append)[0]
    assert not any(b.mlp.fused for b in model.blocks)
    assert any("fused MLP off" in line and "99 KiB" in line for line in lines), lines
    assert "MLP: unfused" in tg.run_report(model, args, torch.device("cpu"), 1)[0]


def test_build_runs_the_mlp_in_bf16_where_fp8_is_missing(tiny_args):
    args = tiny_args(fused_mlp=True, fp8_mlp=True, compile=False)
    lines = []
    model = tg.build(args, torch.device("cpu"), 0, 1, log=lines.append)[0]  # the CPU: no FP8 matmuls in training
    assert not any(b.mlp.fp8 for b in model.blocks)
    assert any(line.startswith("FP8 MLP off") for line in lines), lines
    assert "MLP: fused," in tg.run_report(model, args, torch.device("cpu"), 1)[0]
    model = tg.GPT(tg.ModelConfig.from_args(args), tg.ModelKernels(fused_mlp=True, fp8_mlp=True))  # as on an H100
    assert all(b.mlp.fp8 for b in model.blocks)
    assert "MLP: fused fp8," in tg.run_report(model, args, torch.device("cpu"), 1)[0]


def test_fp8_mlp_refuses_a_hidden_width_its_matmuls_cannot_take_naming_the_field(tiny_args, monkeypatch):
    """The FP8 MLP's e4m3 rows of the hidden width go through TMA (16-byte rows) and cuBLAS (dimensions divisible by
    16): ANVIL2's 2816 (11 x 256, 176 x 16) and our 3072 pass, a width off 16 is refused before the model is built,
    naming --mlp_hidden; the tiles (BLOCK_N 256) ask no multiple."""
    for width in (2816, 3072, 176, 80):
        tg.check_fp8_mlp_shapes(width)
    for width in (2820, 72, 100):
        with pytest.raises(ValueError, match=rf"hidden width \(mlp_hidden, or mlp_ratio x model_dim\) divisible by "
                                             rf"16, not {width}: set --mlp_hidden .*--fp8_mlp false"):
            tg.check_fp8_mlp_shapes(width)
    # build asks it where the FP8 MLP is chosen (as on an H100), of the width mlp_hidden or mlp_ratio x model_dim gives
    monkeypatch.setattr(tg, "choose_kernels", lambda *a, **k: tg.ModelKernels(fused_mlp=True, fp8_mlp=True))
    monkeypatch.setattr(tg, "GPT", None)  # refused before any model is built
    for given in (dict(mlp_hidden=72), dict(model_dim=68, head_dim=34, mlp_ratio=1)):
        with pytest.raises(ValueError, match="--fp8_mlp: .* not (72|68): set --mlp_hidden"):
            tg.build(tiny_args(**given), torch.device("cpu"), 0, 1)


def test_fp8_head_refuses_dimensions_its_matmuls_cannot_take_with_the_fix():
    tg.check_fp8_head_shapes(50304, 768)  # the record's
    for vocab, dim in ((72, 768), (50257, 768), (50304, 100)):
        with pytest.raises(ValueError, match=rf"divisible by 16, not {vocab} and {dim}.*--fp8_head false"):
            tg.check_fp8_head_shapes(vocab, dim)


# kernels.py (the soft-capped cross-entropy of the FP8 head, --fused_ce): the kernels in Triton's
# interpreter and compiled for an H100, the op against the unfused FP8 head and loss, the model's fused
# path, and the kernels on a GPU at the record's shapes.

CAP, SHIFT, TEMP = 23.0, 5.0, 7.5  # the record preset's asymmetric softcap


def softcap_ce_case(T=37, V=101, seed=0, device="cpu", K=None):
    """Logits, targets and upstream gradients; with K, (T, K) targets with weights in [0, 1), a repeated
    target in row 0, a weight of 0 in row 1 and a negative (absent) target of weight 1 in row 2."""
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(T, V, generator=g)).bfloat16()
    targets = torch.randint(0, V, (T,) if K is None else (T, K), generator=g, dtype=torch.int32)
    grad = torch.rand(T, generator=g) * 1e-3
    weights = None
    if K is not None:
        weights = torch.rand(T, K, generator=g)
        weights[:, 0] = 1.0
        targets[0, 1:] = targets[0, 0]
        weights[1, 1:] = 0.0
        targets[2, 1:], weights[2, 1:] = -1, 1.0
        weights = weights.to(device)
    return logits.to(device), targets.to(device), grad.to(device), weights


def softcap_ce_float64(logits, targets, weights):
    """(losses, lse, logits as a float64 leaf) by the formula: sum_k w_tk (lse_t - z_t[y_tk]) over the
    targets that exist (y >= 0)."""
    targets = targets.reshape(targets.size(0), -1).long()
    weights = torch.ones(targets.shape, dtype=torch.float64) if weights is None else weights.double().cpu()
    l64 = logits.double().cpu().requires_grad_(True)
    z = CAP * torch.sigmoid((l64 + SHIFT) / TEMP)
    lse = torch.logsumexp(z, -1)
    losses = torch.zeros(z.size(0), dtype=torch.float64)
    for k in range(targets.size(1)):
        y = targets[:, k].cpu()
        term = weights[:, k] * (lse - z.gather(1, y.clamp(min=0)[:, None])[:, 0])
        losses = losses + torch.where(y >= 0, term, 0.0)
    return losses, lse, l64


def check_softcap_ce_kernels(logits, targets, grad, weights=None):
    """Errors of the kernels against float64 autograd: losses and lse (absolute), the gradient before its
    FP8 cast (relative; the kernel writes float32 here) and whether its transposed copy is exact."""
    import kernels
    losses, lse = kernels.softcap_ce(logits, targets, CAP, SHIFT, TEMP, weights)
    losses64, lse64, l64 = softcap_ce_float64(logits, targets, weights)
    (losses64 * grad.double().cpu()).sum().backward()
    T, V = logits.shape
    g, g_t = torch.empty(T, V, device=logits.device), torch.empty(V, T, device=logits.device)  # float32
    ys, ws = kernels._targets_and_weights(targets, weights)
    kernels._softcap_ce_grad_into(g, g_t, grad, logits, ys, ws, lse, CAP, SHIFT, TEMP, 0.5)
    expected = 2 * l64.grad  # grad_scale 0.5
    return [(losses.double().cpu() - losses64.detach()).abs().max().item(),
            (lse.double().cpu() - lse64.detach()).abs().max().item(),
            ((g.double().cpu() - expected).norm() / expected.norm()).item(), float(not torch.equal(g_t, g.T))]


CE_INTERPRETER_SCRIPT = """
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import kernels, test_kernels as t
assert kernels.triton_runs_on(torch.zeros(1)), "the Triton interpreter is not in use"
kernels.SOFTCAP_CE_TILES = dict(fwd=dict(BLOCK_V=32), bwd=dict(BLOCK_T=16, BLOCK_V=32), targets=dict(BLOCK_R=16))
# 37 x 101: edges masked
print(json.dumps([t.check_softcap_ce_kernels(*t.softcap_ce_case(K=K)) for K in (None, 1, 3)]))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machines' check; the GPU test covers the compiled kernels")
def test_softcap_ce_kernels_match_float64_autograd_in_the_triton_interpreter(tmp_path):
    """The interpreter's float8 casts round wrongly (1.89e-3 becomes 9.8e-4 in e5m2): the kernel writes its
    gradient in float32 here, which checks everything before the cast; the GPU test checks the cast."""
    for K, errors in zip((None, 1, 3), run_in_triton_interpreter(CE_INTERPRETER_SCRIPT, tmp_path)):
        loss_err, lse_err, grad_err, transposed_differs = errors
        assert loss_err < 1e-5 and lse_err < 1e-5 and grad_err < 1e-5 and not transposed_differs, (K, errors)


def test_softcap_ce_reference_takes_weighted_extra_targets_and_ignores_absent_ones():
    """The reference (the kernels' CPU path) against the float64 formula at K = 3, and K targets of which
    only the first has weight: exactly the next-token loss and gradient."""
    import kernels
    logits, targets, grad, weights = softcap_ce_case(K=3)
    losses, lse = kernels.softcap_ce(logits, targets, CAP, SHIFT, TEMP, weights)
    losses64, lse64, l64 = softcap_ce_float64(logits, targets, weights)
    assert (losses.double() - losses64.detach()).abs().max() < 1e-4 and (lse.double() - lse64).abs().max() < 1e-4
    assert losses[2] == kernels.softcap_ce(logits[2:3], targets[2:3, :1], CAP, SHIFT, TEMP)[0][0]  # -1: no term
    one_hot = torch.zeros_like(weights)
    one_hot[:, 0] = 1.0
    plain = kernels.softcap_ce(logits, targets[:, 0], CAP, SHIFT, TEMP)
    assert torch.equal(kernels.softcap_ce(logits, targets, CAP, SHIFT, TEMP, one_hot)[0], plain[0])
    g = kernels.softcap_ce_grad(grad, logits, targets, lse, CAP, SHIFT, TEMP, 2**-20, one_hot)[0]
    assert torch.equal(g.view(torch.uint8), kernels.softcap_ce_grad(grad, logits, targets[:, 0], lse, CAP, SHIFT,
                                                                     TEMP, 2**-20)[0].view(torch.uint8))
    with pytest.raises(ValueError, match=r"weights \(37, 2\) do not match targets \(37, 3\)"):
        kernels.softcap_ce(logits, targets, CAP, SHIFT, TEMP, weights[:, :2])


@pytest.mark.parametrize("K", [1, 3])
def test_softcap_ce_kernels_compile_for_an_h100_without_one(K):
    """Compiled for sm_90 as Triton's JIT compiles them for the record (sizes and pointers divisible by 16),
    with the next-token target alone or with two extra targets: every load and store over the (tokens x
    vocab) tensors moves 16 bytes, the transposed e5m2 copy goes through shared memory, and the softcap's
    sigmoid is one tanh.approx.f32 per entry and no division, whatever the number of targets. Only the
    targets' own entries are read and written one at a time: one 2-byte gather in the forward (one more
    tanh), and the targets kernel's K reads, K tanh and 2K one-byte stores."""
    import re
    import kernels
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    types = dict(logits_ptr="*bf16", targets_ptr="*i32", weights_ptr="*fp32", losses_ptr="*fp32", lse_ptr="*fp32",
                 grad_ptr="*fp32", g_ptr="*fp8e5", g_t_ptr="*fp8e5", T="i32", V="i32", cap="fp32", inv_cap="fp32",
                 inv_temp="fp32", shift_over_temp="fp32", inv_grad_scale="fp32")
    ops = {}
    for fn, tiles, targets in [(kernels._softcap_ce_fwd_kernel, kernels.SOFTCAP_CE_TILES["fwd"],
                                dict(K=K, BLOCK_K=triton.next_power_of_2(K))),
                               (kernels._softcap_ce_bwd_kernel, kernels.SOFTCAP_CE_TILES["bwd"], dict(K=K)),
                               (kernels._softcap_ce_bwd_targets_kernel, kernels.SOFTCAP_CE_TILES["targets"],
                                dict(K=K))]:
        constexprs = {**{k: v for k, v in tiles.items() if k.isupper()}, **targets}
        signature = {n: "constexpr" if n in constexprs else types[n] for n in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                   if n.endswith("_ptr") or n in ("T", "V")}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": tiles["num_warps"]})
        assert len(compiled.asm["cubin"]) > 1000, fn.__name__
        found = re.findall(r"^\s*(?:@%p\d+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", compiled.asm["ptx"], re.M)
        entries_per_thread = tiles.get("BLOCK_T", 1) * tiles.get("BLOCK_V", 0) // (32 * tiles["num_warps"])
        divisions = found.count("div.full.f32") + found.count("div.rn.f32") + found.count("rcp.approx.ftz.f32")
        assert divisions == 0, (fn.__name__, divisions)
        ops[fn.__name__] = (found, found.count("tanh.approx.f32"), entries_per_thread)
    (fwd, fwd_tanh, fwd_n), (bwd, bwd_tanh, bwd_n) = ops["_softcap_ce_fwd_kernel"], ops["_softcap_ce_bwd_kernel"]
    hit, hit_tanh, _ = ops["_softcap_ce_bwd_targets_kernel"]
    fwd, bwd = set(fwd) - {"ld.global.b16"} if fwd.count("ld.global.b16") == 1 else set(fwd), set(bwd)
    assert "ld.global.v4.b32" in fwd and "ld.global.v4.b32" in bwd and "st.global.v4.b32" in bwd
    assert not {"ld.global.b16", "st.global.b8"} & (fwd | bwd), (fwd, bwd)
    assert (hit.count("ld.global.b16"), hit_tanh, hit.count("st.global.b8")) == (K, K, 2 * K), hit
    # the e5m2 tile (bytes), not the bf16 input, goes through shared memory to be transposed (Triton 3.6 had
    # transposed the input with ldmatrix.trans and computed everything twice: the tanh count below)
    assert "st.shared.b8" in bwd and any(op.startswith("ld.shared") for op in bwd) and "ldmatrix" not in str(bwd)
    assert (fwd_tanh, bwd_tanh) == (fwd_n + 1, bwd_n), ops


def fp8_head_ce_case(T=64, dim=128, V=256, device=DEVICE):
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.rms_norm(torch.randn(T, dim, generator=g), (dim,)).to(device, torch.bfloat16)
    w = (0.05 * torch.randn(V, dim, generator=g)).to(device)
    return x, w, torch.randint(0, V, (T,), generator=g, dtype=torch.int32).to(device)


def unfused_fp8_head_ce(x, w, targets):
    logits = torch.ops.speedrun.mm_fp8(x, w, tg.head_x_scale(x.size(1)), tg.HEAD_W_SCALE, tg.HEAD_GRAD_SCALE)[0]
    z = CAP * torch.sigmoid((logits.float() + SHIFT) / TEMP)
    return torch.logsumexp(z, -1) - z.gather(1, targets.long()[:, None])[:, 0]


def fused_fp8_head_ce(x, w, targets, weights=None):
    """The fused op on (T,) next-token targets, or on (T, K) targets with their weights."""
    if weights is None:
        targets, weights = targets[:, None], torch.ones(targets.size(0), 1, device=targets.device)
    return torch.ops.speedrun.fp8_head_ce(x, w, targets, weights, tg.head_x_scale(x.size(1)), tg.HEAD_W_SCALE,
                                          tg.HEAD_GRAD_SCALE, CAP, SHIFT, TEMP)[0]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="the FP8 head runs on CUDA GPUs of sm89+")
def test_fp8_head_forward_and_backward_never_wait_for_the_gpu():
    """After a first call (which makes the fixed scales' device tensors), the fused FP8 head's forward and
    backward queue their work without one synchronizing operation: a scale made anew each call from a Python
    float was a blocking host-to-device copy, six stream waits per micro-batch."""
    x0, w0, targets = fp8_head_ce_case(T=4096, dim=768, V=50304)
    for strict in (False, True):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        weights = torch.ones(x.size(0), 1, device=DEVICE)
        torch.cuda.set_sync_debug_mode("error" if strict else "default")
        try:
            fused_fp8_head_ce(x, w, targets[:, None], weights).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(w.grad).all()


def test_fixed_fp8_scales_are_made_once_per_device():
    import kernels
    a = kernels.scale_tensor(0.25, torch.device("cpu"))
    assert a is kernels.scale_tensor(0.25, torch.device("cpu")) and a.dtype == torch.float32 and a.item() == 0.25
    assert kernels.scale_tensor(0.5, torch.device("cpu")).item() == 0.5


def test_fp8_head_ce_op_gives_the_unfused_heads_losses_and_gradients_compiled_or_not():
    """Same FP8 matmuls; the fused op keeps the logits in e4m3 (HEAD_LOGITS_DTYPE), the unfused head in bf16, so its
    losses are a little further from float64 autograd (at most 1.5 times here: the operands' own e4m3 rounding
    dominates); the gradients differ in how the logits' gradient rounds to e5m2 (from float32 here, from bf16
    there), by as much as e5m2's own error when a row's entries are alike: both are as far from float64 autograd."""
    if not tg.kernels.fp8_supported(DEVICE):
        pytest.skip(f"_scaled_mm FP8 does not run on {DEVICE}")
    x0, w0, targets = fp8_head_ce_case()
    weights = torch.rand(x0.size(0), generator=torch.Generator().manual_seed(1)).to(DEVICE)  # per-token upstream grads
    xr, wr = x0.double().requires_grad_(True), w0.double().requires_grad_(True)
    z = CAP * torch.sigmoid((xr @ wr.T + SHIFT) / TEMP)
    expected = torch.logsumexp(z, -1) - z.gather(1, targets.long()[:, None])[:, 0]
    (expected * weights.double()).sum().backward()
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    errors = []
    compiled = torch.compile(fused_fp8_head_ce, fullgraph=True, backend="aot_eager")
    for fn in (unfused_fp8_head_ce, fused_fp8_head_ce, compiled):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        losses = fn(x, w, targets)
        (losses * weights).sum().backward()
        assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
        errors.append([rel(losses.detach(), expected.detach()), rel(x.grad, xr.grad), rel(w.grad, wr.grad)])
    for fused in errors[1:]:
        assert fused[0] < 1.5 * errors[0][0], errors  # about the same losses, from e4m3 logits
        assert all(f < 1.1 * u + 0.005 and f < 0.1 for f, u in zip(fused[1:], errors[0][1:])), errors
    with torch._subclasses.FakeTensorMode():  # the fakes give the real shapes and dtypes
        x, w = torch.empty(8, 32, dtype=torch.bfloat16, requires_grad=True), torch.empty(16, 32, requires_grad=True)
        out = torch.ops.speedrun.fp8_head_ce(x, w, torch.zeros(8, 2, dtype=torch.int32), torch.ones(8, 2), 0.1, 0.1,
                                             0.1, CAP, SHIFT, TEMP)
        out[0].sum().backward()
    assert [(t.shape, t.dtype) for t in out] == [((8,), torch.float32), ((8,), torch.float32),
                                                 ((8, 16), torch.float8_e4m3fn),
                                                 ((32, 8), torch.float8_e4m3fn), ((32, 16), torch.float8_e4m3fn),
                                                 ((8, 2), torch.float32)]
    assert (x.grad.shape, x.grad.dtype) == ((8, 32), torch.bfloat16)
    assert (w.grad.shape, w.grad.dtype) == ((16, 32), torch.float32)


def test_fp8_head_ce_terms_carry_any_losss_gradient_as_the_unfused_head():
    """The per-target terms lse - z of the op, used by a loss that is no weighted sum of them (here a mixture, as
    CPLM's), and its weighted losses at once: the same values and gradients as the unfused FP8 head."""
    if not tg.kernels.fp8_supported(DEVICE):
        pytest.skip(f"_scaled_mm FP8 does not run on {DEVICE}")
    x0, w0, targets = fp8_head_ce_case()
    targets = torch.stack([targets, (targets * 7 + 3) % w0.size(0)], 1)  # two targets per token
    weights = torch.tensor([0.0, 0.5], device=DEVICE).expand(x0.size(0), 2).contiguous()

    def mixture(terms, losses):
        return (-torch.log(torch.exp(-terms[:, 0]) + 0.3 * torch.exp(-terms[:, 1])) + losses).sum()
    results = []
    for fused in (False, True):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if fused:
            out = torch.ops.speedrun.fp8_head_ce(x, w, targets, weights, tg.head_x_scale(x.size(1)), tg.HEAD_W_SCALE,
                                                 tg.HEAD_GRAD_SCALE, CAP, SHIFT, TEMP)
            terms, losses = out[5], out[0]
        else:
            logits = torch.ops.speedrun.mm_fp8(x, w, tg.head_x_scale(x.size(1)), tg.HEAD_W_SCALE, tg.HEAD_GRAD_SCALE)[0]
            z = CAP * torch.sigmoid((logits.float() + SHIFT) / TEMP)
            terms = torch.logsumexp(z, -1)[:, None] - z.gather(1, targets.long())
            losses = (terms * weights).sum(1)
        loss = mixture(terms, losses)
        loss.backward()
        results.append((loss.detach(), x.grad.float(), w.grad))
    (l0, gx0, gw0), (l1, gx1, gw1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-3, atol=1e-3)  # e4m3 logits in the op, bf16 in the unfused head
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    assert rel(gx1, gx0) < 0.05 and rel(gw1, gw0) < 0.05, (rel(gx1, gx0), rel(gw1, gw0))  # e5m2 gradients


@pytest.mark.parametrize("cplm", [False, True], ids=["next_token", "cplm"])
def test_model_with_fused_ce_trains_on_the_fp8_heads_losses_and_gradients(cplm):
    """The model's loss with the fused op is the FP8 head's (to e4m3 logits' rounding); its gradients lie as close to the bf16
    head's as the unfused FP8 head's do (FP8 rounding, not the fusion, sets the difference). With CPLM the
    fused op's terms feed the mixture (the copy column 64 of a vocabulary of 80)."""
    if not tg.kernels.fp8_supported(DEVICE):
        pytest.skip(f"_scaled_mm FP8 does not run on {DEVICE}")
    from conftest import TINY
    # FP8 matmuls need multiples of 16 (TINY's 72 failed here on an H200, 2026-11-30)
    extra = dict(vocab_size=80, cplm_bands=(32, 64)) if cplm else dict(vocab_size=80)
    args = tg.Hyperparameters(**{**TINY, "logit_softcap": CAP, "softcap_shift": SHIFT, **extra})
    results = []
    for fp8, fused in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        model = tg.GPT(tg.ModelConfig.from_args(args), tg.ModelKernels(fp8_head=fp8, fused_ce=fused)).to(DEVICE)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p.float()).to(p.dtype))
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, TINY["vocab_size"] // (4 if cplm else 1), (128,), generator=g, dtype=torch.int32).to(DEVICE)
        y = torch.randint(0, TINY["vocab_size"] // (4 if cplm else 1), (128,), generator=g, dtype=torch.int32).to(DEVICE)
        cu = torch.tensor([0, 128], dtype=torch.int32, device=DEVICE)
        loss = model(x, y, cu, 128, tg.window_tokens(3, TINY["window_block"]))
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters()
                                                   if p.grad is not None])))  # a tied table has none
        assert model.kernels.fused_ce == fused
    # only ever the FP8 head's loss: choose_kernels turns it off with the FP8 head
    assert not tg.choose_kernels(torch.device("cpu"), fp8_head=False, fused_ce=True, log=lambda line: None).fused_ce
    (_, g_bf16), (l_fp8, g_fp8), (l_fused, g_fused) = results
    torch.testing.assert_close(l_fused, l_fp8, rtol=1e-3, atol=1e-3)  # e4m3 logits (fused) against bf16 (unfused)
    rel = lambda a: ((a - g_bf16).norm() / g_bf16.norm()).item()
    assert rel(g_fused) < 1.2 * rel(g_fp8) + 0.01 and rel(g_fused) < 0.1, (rel(g_fused), rel(g_fp8))


def test_build_keeps_the_unfused_loss_where_the_head_is_not_fp8(tiny_args):
    lines = []
    args = tiny_args(fused_ce=True, compile=False)
    model = tg.build(args, torch.device("cpu"), 0, 1, log=lines.append)[0]  # training on the CPU: a bf16 head
    assert not model.kernels.fused_ce and any("fused cross-entropy off" in line for line in lines), lines
    assert "cross-entropy: unfused" in tg.run_report(model, args, torch.device("cpu"), 1)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a CUDA GPU")
def test_softcap_ce_kernels_on_the_gpu_at_the_record_shapes():
    """Against float64 autograd at 4,113 tokens x 50,304; then at 43,008 tokens, past 2^31 entries (the
    kernels' 64-bit offsets), the e5m2 gradient against the reference's cast of its float32 values, by
    chunks of rows: equal but for one-step roundings. The kernels' sigmoid is tanh.approx.f32 (relative error
    below 2^-10.9), so z = cap sigmoid(u) may be off by cap 2^-11.9: z_err bounds lse, twice it a target's term
    (K = 3: three terms of weight <= 1), and the gradient's relative error stays near 2 z_err."""
    import kernels
    z_err = CAP * 2**-11.9
    for K, terms in ((None, 1), (3, 3)):
        errors = check_softcap_ce_kernels(*softcap_ce_case(T=4096 + 17, V=50304, device="cuda", K=K))
        loss_err, lse_err, grad_err, transposed_differs = errors
        assert loss_err < 2 * terms * z_err and lse_err < z_err and grad_err < 4 * z_err, (K, errors)
        assert not transposed_differs, (K, errors)
    logits, targets, grad, _ = softcap_ce_case(T=43008, V=50304, device="cuda")
    losses, lse = kernels.softcap_ce(logits, targets, CAP, SHIFT, TEMP)
    g, g_t = kernels.softcap_ce_grad(grad, logits, targets, lse, CAP, SHIFT, TEMP, tg.HEAD_GRAD_SCALE)
    assert torch.equal(g_t.view(torch.uint8), g.T.contiguous().view(torch.uint8))
    for rows in torch.arange(logits.size(0), device="cuda").split(4096):
        ref_losses, ref_lse = kernels.softcap_ce_reference(logits[rows], targets[rows], CAP, SHIFT, TEMP)
        assert (losses[rows] - ref_losses).abs().max() < 2 * z_err and (lse[rows] - ref_lse).abs().max() < z_err
        ref, _ = kernels.softcap_ce_grad_reference(grad[rows], logits[rows], targets[rows], lse[rows], CAP, SHIFT,
                                                   TEMP, tg.HEAD_GRAD_SCALE)
        codes, ref_codes = g[rows].view(torch.uint8).int(), ref.view(torch.uint8).int()
        same = (codes == ref_codes).float().mean().item()
        assert same > 0.95 and (codes - ref_codes).abs().max() <= 1, (rows[0].item(), same)  # one e5m2 step at most


# kernels.copy_pointer (CPLM's pointer): its Triton kernels in the interpreter against the (T, T)-mask reference and
# the model's written-out pointer, gradients included; on a GPU the compiled kernels.

def copy_pointer_case(T=130, band=32, D=128, seed=0, cu=(0, 37, 60, 61)):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, D, generator=g) * 0.3 for _ in range(2))
    sink = torch.randn(T, generator=g)
    cu = torch.tensor([*cu, T])  # a one-token document too
    start = cu[kernels.document_ids(cu, T) - 1].int()
    tokens, targets = (torch.randint(0, 5, (T,), generator=g, dtype=torch.int32) for _ in range(2))
    return q, k, sink, start, tokens, targets, band, cu


def check_copy_pointer_op(q, k, sink, start, tokens, targets, band, cu) -> list[float]:
    """Max abs errors of the op's p_copy, a_sink and the gradients of q, k, sink against the reference."""
    g = torch.Generator().manual_seed(1)
    up = torch.randn(2, q.size(0), generator=g).to(q.device)
    got, want = [], []
    for fn, out in ((lambda *a: kernels.copy_pointer(*a)[:2], got), (kernels.copy_pointer_reference, want)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, sink)]
        p, a = fn(*leaves, start, tokens, targets, band)
        (p * up[0] + a * up[1]).sum().backward()
        out += [p, a, *(t.grad for t in leaves)]
    return [(x - y).abs().max().item() for x, y in zip(got, want)]


POINTER_SCRIPT = """
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import kernels, train_gpt as tg, test_kernels as t
assert kernels.triton_runs_on(torch.zeros(1)), "the Triton interpreter is not in use"
errors = t.check_copy_pointer_op(*t.copy_pointer_case()) + t.check_copy_pointer_op(*t.copy_pointer_case(T=100, band=16))
# short documents in long bands: the key gradient's loop stops at the last key's document end, query blocks early
errors += t.check_copy_pointer_op(*t.copy_pointer_case(T=256, band=128, cu=(0, 20, 90, 95, 200)))
# the model's pointer through the kernel against its written-out path (the one CPUs run)
from conftest import TINY
cfg = tg.ModelConfig.from_args(tg.Hyperparameters(**dict(TINY, vocab_size=80, cplm_bands=(32, 64))))
model = tg.GPT(cfg, tg.ModelKernels(pointer=True))  # as choose_kernels picks it in the interpreter
written_out = tg.GPT(cfg)  # PyTorch's pointer, with the same weights
written_out.load_state_dict(model.state_dict())
x = torch.randn(150, TINY["model_dim"])
inputs, targets = torch.randint(0, 6, (150,)), torch.randint(0, 6, (150,))
cu = torch.tensor([0, 50, 51, 150])
for training in (True, False):
    model.train(training)
    written_out.train(training)
    kernel = model.copy_pointer(x, inputs, targets, cu)
    plain = written_out.copy_pointer(x, inputs, targets, cu)
    errors += [(a - b).abs().max().item() for a, b in zip(kernel, plain)]
print(json.dumps(errors))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machines' check; the GPU test covers the compiled kernels")
def test_copy_pointer_kernels_match_the_reference_and_the_written_out_pointer_in_the_interpreter(interpreted):
    errors = interpreted["pointer"]
    assert len(errors) == 19 and max(errors) < 1e-5, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copy_pointer_kernels_on_the_gpu_match_the_reference():
    case = copy_pointer_case(T=3000, band=512)
    q, k, sink, start, tokens, targets = (t.cuda() for t in case[:6])
    errors = check_copy_pointer_op(q, k, sink, start, tokens, targets, case[6], case[7])
    assert max(errors) < 2e-3, errors  # TF32 scores (10-bit mantissa)


def test_copy_pointer_kernels_compile_for_an_h100_without_one():
    """The pointer's three kernels with kernels.POINTER_TILES, compiled for sm_90 down to a cubin (no GPU needed): what
    only the compiler rejects, shared memory over the H100's 227 KiB included."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    tiles = kernels.POINTER_TILES
    constexprs = dict(D=tg.COPY_DIM, BM=tiles["BM"], BN=tiles["BN"])
    for fn in (kernels._pointer_fwd_kernel, kernels._pointer_dq_kernel, kernels._pointer_dk_kernel):
        signature = {n: "constexpr" if n in constexprs else
                     ("*i32" if n in ("start_ptr", "end_ptr", "tok_ptr", "tgt_ptr") else "*fp32") if n.endswith("_ptr") else "i32"
                     for n in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=tiles["num_warps"], num_stages=tiles["num_stages"]))
        assert len(compiled.asm["cubin"]) > 1000 and compiled.metadata.shared <= 227 * 1024, fn.__name__


def test_softcap_ce_kernels_compile_for_e4m3_logits_on_an_h100_without_one():
    """The loss kernels read the fused head's e4m3 logits (HEAD_LOGITS_DTYPE): compiled for sm_90 down to a cubin
    (no GPU needed) with kernels.SOFTCAP_CE_TILES, three targets per token."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    assert kernels.HEAD_LOGITS_DTYPE == torch.float8_e4m3fn
    numbers = {"cap", "inv_cap", "inv_temp", "shift_over_temp", "inv_grad_scale"}
    pointers = dict(logits_ptr="*fp8e4nv", targets_ptr="*i32", g_ptr="*fp8e5", g_t_ptr="*fp8e5")
    for fn, tiles, extra in ((kernels._softcap_ce_fwd_kernel, "fwd", dict(K=3, BLOCK_K=4)),
                             (kernels._softcap_ce_bwd_kernel, "bwd", dict(K=3)),
                             (kernels._softcap_ce_bwd_targets_kernel, "targets", dict(K=3))):
        tiles = kernels.SOFTCAP_CE_TILES[tiles]
        constexprs = {**{k: v for k, v in tiles.items() if k.isupper()}, **extra}
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "*fp32") if n.endswith("_ptr")
                     else "fp32" if n in numbers else "i32" for n in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=tiles["num_warps"]))
        assert len(compiled.asm["cubin"]) > 1000, fn.__name__
