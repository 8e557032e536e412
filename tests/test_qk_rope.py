"""bench/qk_rope.py's CPU side: the pass it times is the attention's own work between its QKV matmul and the
attention, and its count of the bytes that pass must move."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import qk_rope  # noqa: E402
import train_gpt as tg  # noqa: E402  (qk_rope put the repository on the path)
from test_model import TINY  # noqa: E402


def test_the_timed_pass_is_the_attentions_q_k_and_v():
    cfg = tg.ModelConfig.from_args(tg.Hyperparameters(**TINY))
    g = torch.Generator().manual_seed(0)
    seen = []
    attn = tg.CausalSelfAttention(cfg, lambda q, k, v, *a: seen.append((q, k, v)) or v, ve_gate=False,
                                  key_offset=False, paired=False)
    T, H, D = 20, cfg.num_heads, cfg.head_dim
    x = torch.randn(T, cfg.model_dim, generator=g)
    lambdas = torch.tensor([0.7, 0.0])
    cos, sin, scale = tg.Rotary(D, T, cfg.rotary_min_freq).at(0)
    one = torch.ones(())
    w = tg.BlockWeights(one, one, one, one, one, lambdas)
    attn(x, None, w, None, T, 16, (cos, sin, scale))
    qkv = torch.nn.functional.linear(x, attn.qkvo_w[:3].flatten(0, 1)).view(T, 3 * H, D)
    for mine, model in zip(qk_rope.qk_rope(qkv, lambdas[0], cos, sin), seen[0]):
        torch.testing.assert_close(mine, model, rtol=0, atol=0)


def test_least_bytes_count_each_tensor_once():
    one, tables = 2 * 1 * 4 * 2, 2 * 2 * 2 * 4  # 2 tokens x 1 head x 4 dims in bf16; cos and sin (2, 2) in float32
    assert qk_rope.least_bytes(2, 1, 4) == (6 * one + tables, 8 * one + tables)
    fwd, bwd = qk_rope.least_bytes(49152, 6, 128)
    assert round(fwd / 1e6) == 478 and round(bwd / 1e6) == 629  # the record's micro-batch


def test_it_says_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["qk_rope.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        qk_rope.main()


def test_the_report_puts_each_pass_beside_its_bytes_at_the_copys_bandwidth():
    # a copy of 1 GB in 0.5 ms: 2,000 GB/s; forward and backward 1 GB each in 1 ms each
    lines = qk_rope.report(1.0, 2.0, 0.5, 10 ** 9, (10 ** 9, 10 ** 9), 10)
    assert "2000 GB/s" in lines[0]
    assert lines[1].startswith("forward") and "(50% of the copy's)" in lines[1]
    assert "at copy speed  500.0 us" in lines[1]
    assert lines[3].startswith("both") and "at copy speed 1000.0 us" in lines[3]
    assert lines[4] == "a step of 10 passes: 20.0 ms in this pass, 10.0 ms above copy speed"
