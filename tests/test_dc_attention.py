"""dc_attention: DC attention in the last block (the 2026-05-27 record's lightweight DCMHA), which ANVIL2 (#92) runs
without. Off, the model is the one with DC whose correction is zero: the MUDD gates lose DC's two outputs, nothing
else changes."""
import torch

import train_gpt as tg
from conftest import compiled_matches_eager
from test_model import batch, tiny_model
from test_skip_layers import W3


def gate_entries(model: tg.GPT) -> list[tuple]:
    return [e for part in model.gate_layout() for e in part]


def transplant(dc: tg.GPT, plain: tg.GPT) -> None:
    """dc's weights into plain (no DC attention): each parameter of the same name as it is, and the MUDD gates' second
    layer and biases row by row (DC's outputs are the second gate's last, so each gate's other rows keep their order;
    the gates' padding to a multiple of 8 may differ)."""
    src, dst = dc.state_dict(), plain.state_dict()
    with torch.no_grad():
        for name, t in dst.items():
            if name not in ("mudd_gate_w2", "mudd_gate_b2"):
                t.copy_(src[name])  # an error here: the two models differ in more than the gates
        wide, narrow = dc.gate_width, plain.gate_width
        for j, part in enumerate(plain.gate_layout()):
            n = sum(e[2] for e in part)
            for name in ("mudd_gate_w2", "mudd_gate_b2"):
                dst[name][j * narrow: j * narrow + n] = src[name][j * wide: j * wide + n]
        dst["mudd_gate_b2"][-8:] = src["mudd_gate_b2"][-8:]  # the gates' common scale


def test_off_the_gates_lose_dcs_outputs_and_dc_is_never_computed(monkeypatch):
    calls = []
    real = tg.dc_correction
    monkeypatch.setattr(tg, "dc_correction", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, y, cu = batch()
    on, off = tiny_model(True), tiny_model(True, dc_attention=False)
    on(x, y, cu, 128, W3)
    assert calls == [1]  # once a forward, in the last block
    assert gate_entries(off) == [e for e in gate_entries(on) if e[0] not in ("dc1", "dc2")]
    assert {e[0] for e in gate_entries(on)} >= {"dc1", "dc2"}
    loss = off(x, y, cu, 128, W3)
    loss.backward()
    assert calls == [1] and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in off.parameters() if p.grad is not None)
    assert off.blocks[-1].attn.qkvo_w.grad.abs().sum() > 0


def test_off_computes_what_the_model_with_dc_computes_when_its_correction_is_zero(monkeypatch):
    x, y, cu = batch()
    dc, plain = tiny_model(True), tiny_model(True, dc_attention=False)
    transplant(dc, plain)
    with_dc = dc(x, y, cu, 128, W3)
    monkeypatch.setattr(tg, "dc_correction", lambda q, k, v, *a, **kw: torch.zeros_like(v))
    torch.testing.assert_close(plain(x, y, cu, 128, W3), dc(x, y, cu, 128, W3), rtol=1e-6, atol=1e-6)
    assert abs(with_dc.item() - plain(x, y, cu, 128, W3).item()) > 1e-3  # and DC, on, changes the loss


def test_off_the_model_compiles_whole_and_computes_the_same():
    compiled_matches_eager(tiny_model(True, dc_attention=False), *batch(), 128, W3)
