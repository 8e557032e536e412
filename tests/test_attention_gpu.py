"""GPU numerics of every installed fast attention backend (fa3, fa4, varlen) against the reference
path: forward output and the gradients of q, k and v, bf16 kernels against float32 math on the same
bf16 inputs, sliding windows of 128 to 2048 tokens, several document layouts including padded
cu_seqlens. Tolerance: relative Frobenius error below 1e-2 for the output and 2e-2 for each gradient
(bf16 rounding gives ~3e-3; a wrong mask, window or scale gives > 0.1). Needs a CUDA GPU."""

import pytest
import torch

import kernels
import train_gpt as tg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the attention kernels under test need a CUDA GPU")
DEVICE = torch.device("cuda")
BACKENDS = [b for b in kernels.available_attention_backends(DEVICE) if b != "reference"] if torch.cuda.is_available() else []
T = 4096
LAYOUTS = {  # document lengths; cu_seqlens is padded with repeats of T where marked
    "one document": ([T], 0),
    "mixed, with a one-token document": ([1, 127, 900, 2000, 1068], 0),
    "many short documents": ([64] * 64, 0),
    "padded, as the loader pads": ([700, 1500, 1896], 5),
}


def _rel(a, b):
    return float((a.float() - b).norm() / b.norm())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [128, 384, 896, 1408, 2048])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backend_matches_reference_forward_and_gradients(backend, window, layout):
    lengths, padding = LAYOUTS[layout]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()] + [T] * padding, dtype=torch.int32, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(window)
    q, k, v = (torch.randn(T, 6, 128, device=DEVICE, generator=g, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    grad_out = torch.randn(T, 6, 128, device=DEVICE, generator=g, dtype=torch.bfloat16)
    scale = 0.12
    out = tg.ATTENTION_BACKENDS[backend](q, k, v, cu, max(lengths), window, scale)
    out.backward(grad_out)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = tg.attention_reference(qr, kr, vr, cu, max(lengths), window, scale)
    ref.backward(grad_out.float())
    errors = {"out": _rel(out, ref), "dq": _rel(q.grad, qr.grad), "dk": _rel(k.grad, kr.grad), "dv": _rel(v.grad, vr.grad)}
    assert errors["out"] < 1e-2 and max(errors.values()) < 2e-2, f"{backend}, window {window}, {layout}: {errors}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_compiled_fullgraph_equals_eager(backend):
    """Inductor with fullgraph, as the training step compiles it: the custom ops stay opaque."""
    cu = torch.tensor([0, 1000, 3000, T, T], dtype=torch.int32, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(T, 6, 128, device=DEVICE, generator=g, dtype=torch.bfloat16)

    def f(x):
        return tg.ATTENTION_BACKENDS[backend](x * 1.5, x.flip(0), x, cu, 2000, 384, 0.12).float().square().sum()
    grads = []
    for fn in (f, torch.compile(f, fullgraph=True, dynamic=False)):
        leaf = x.clone().requires_grad_()
        fn(leaf).backward()
        grads.append(leaf.grad)
    assert _rel(grads[1], grads[0].float()) < 1e-2  # inductor fuses the bf16 ops around the kernel differently
