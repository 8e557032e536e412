"""Every preset resolves to the run it resolved to when tests/data/presets_pinned.json was written: each
hyperparameter, and the schedule as Schedule resolves it (steps, batch, micro-batch, document cut,
windows, lr, multi-token prediction, prefix-token loss). A change that means to alter a preset rewrites the file with
`python tests/test_presets.py --write` and shows the difference in its diff."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402

PINNED = Path(__file__).resolve().parent / "data" / "presets_pinned.json"


def resolved(name: str) -> dict:
    """The preset's fields (paths under DATA_PATH written relative to it) and its concrete schedule."""
    args = tg.parse_args(["--preset", name])
    fields = {}
    for key, value in dataclasses.asdict(args).items():
        if key == "stages":
            continue
        if isinstance(value, str) and value.startswith(tg.DATA_PATH):
            value = "<DATA_PATH>" + value[len(tg.DATA_PATH):]
        fields[key] = list(value) if isinstance(value, tuple) else value
    stages = [[st.start, st.end, st.spec.batch_size, st.spec.seq_len, st.spec.max_doc_len, list(st.windows),
               list(st.prefix_ramp), st.lr, [list(m) for m in st.mtp_ramp], st.candidates]
              for st in tg.Schedule(args).stages]
    return dict(fields=fields, stages=stages)


@pytest.mark.parametrize("name", list(tg.PRESETS))
def test_every_preset_resolves_to_its_pinned_run(name):
    pinned = json.loads(PINNED.read_text())
    assert set(pinned) == set(tg.PRESETS), "a preset was added or removed: rewrite the pin (--write)"
    now = resolved(name)
    assert now["stages"] == pinned[name]["stages"]
    changed = {k: (pinned[name]["fields"].get(k, "(absent)"), now["fields"].get(k, "(absent)"))
               for k in set(now["fields"]) | set(pinned[name]["fields"])
               if now["fields"].get(k, "(absent)") != pinned[name]["fields"].get(k, "(absent)")}
    assert not changed, f"--preset {name}: pinned -> now {changed}"


def test_the_pin_notices_a_changed_stage(monkeypatch):
    rows = tg.SMOKE["stages"]
    monkeypatch.setitem(tg.SMOKE, "stages", (dataclasses.replace(rows[0], doc_len=128), *rows[1:]))
    with pytest.raises(AssertionError):
        test_every_preset_resolves_to_its_pinned_run("smoke")


# fields whose default is 0, -1, False or () but that choose how a run is controlled, not what it learns
# (max_num_docs: 0 sizes the padding of cu_seqlens from the data; a set count only pads more or refuses a batch)
RUN_CONTROL = {"seed", "plan", "peak_tflops", "save_every", "markov_corpus", "max_num_docs"}
# techniques added off, waiting on GPU runs to be adopted into a preset or deleted (each names what decides it)
PENDING_ADOPTION: set[str] = {
    # Muon's collectives in bf16 (the float32 matrices kept by their owner): decided on two GPUs at the 8-GPU record's
    # per-GPU shape (bench/comm_time.py, exposed moving data with it and without) and 80 same-seed steps there
    "muon_bf16_comm",
    # the n-gram table's rows stored scattered (ngram_spread), so every GPU's block holds its share of the bigram
    # channel: the same model relabelled; on two H200s the ranks' waiting 1.94 against 3.13 ms a step, the step within
    # two processes' spread (2026-12-01, 377,280 bigram rows); decided by the step on more GPUs, where in row order
    # the trigram half of the GPUs serves ~1.9x the distinct rows of the bigram half (even split, 2026-12-03)
    "ngram_spread",
    # ANVIL2's period-4 cadence of the value-embedding and n-gram tables (4 from 0.28 of the run, its step 336 of
    # 1194): decided by 3 paired seeds on the proxy at 840 steps (--table_adam_every 4,0.28) and the exposed moving
    # data on two GPUs at the 8-GPU record's per-GPU shape (bench/comm_time.py)
    "table_adam_every"}


def test_no_technique_is_off_in_every_preset():
    """A technique field (default off: False, 0, -1 or ()) is on in some preset, and so are the stage table's
    multi-token, prefix-token and sampled-softmax columns: a technique no preset uses is deleted, not kept behind a
    flag."""
    default, presets = tg.Hyperparameters(), [tg.parse_args(["--preset", name]) for name in tg.PRESETS]
    off = [f.name for f in dataclasses.fields(tg.Hyperparameters)
           if f.name not in RUN_CONTROL | PENDING_ADOPTION
           and (getattr(default, f.name) is False or getattr(default, f.name) in (0, -1, ()))
           and all(getattr(args, f.name) == getattr(default, f.name) for args in presets)]
    assert off == []
    for column in ("mtp", "prefix", "candidates"):
        values = [getattr(row, column) for args in presets for row in args.stages]
        assert any(any(v) if isinstance(v, tuple) else v for v in values), column
    record = tg.parse_args(["--preset", "record"])
    with torch.device("meta"):
        model = tg.GPT(tg.ModelConfig.from_args(record))
    # ANVIL2's architecture (record #92): block 7 removed, no attention in 4, 6 and 9, a second MLP in block 8, 2816
    assert len(model.blocks) == 11 and model.smear_w is not None
    assert [i for i, b in enumerate(model.blocks) if isinstance(b, tg.SkippedBlock)] == [7]
    assert [i for i, b in enumerate(model.blocks) if b.attn is None] == [4, 6, 7, 9]
    assert [i for i, b in enumerate(model.blocks) if b.parallel_mlp is not None] == [8]
    assert model.blocks[0].mlp.fc_w.shape == (768, 2816) and model.blocks[8].parallel_mlp.fc_w.shape == (768, 2816)
    # the value-embedding gates: the blocks' own, and MUDD's per token in the last block (10)
    assert [i for i, b in enumerate(model.blocks) if b.attn is not None and b.attn.ve_gate_w is not None] == [1, 2, 8]
    # the presets of other depths keep the layout before it (ANVIL2's indices are the 11 blocks'), MLPs 4 x model_dim
    for name in ("smoke", "medium"):
        args = tg.parse_args(["--preset", name])
        with torch.device("meta"):
            model = tg.GPT(tg.ModelConfig.from_args(args))
        assert [i for i, b in enumerate(model.blocks) if b.attn is None] == list(args.no_attn_layers), name
        assert not any(isinstance(b, tg.SkippedBlock) or b.parallel_mlp is not None for b in model.blocks), name
        assert model.blocks[0].mlp.fc_w.shape == (args.model_dim, 4 * args.model_dim), name
        assert not (args.no_x0_blocks or args.no_ngram_blocks or args.no_resid_scale_blocks), name


def test_a_checkpoint_of_the_two_model_era_is_refused_with_the_commit_to_use(tmp_path):
    """model.pt written before checkpoint format 2 (one model): refused in one line naming its code hash, whatever
    else it holds; this format's file reads."""
    saved = dict(model={}, step=4, args={}, world_size=1, code_hash="0123abcd", training_time_ms=1.0)
    torch.save(saved, tmp_path / "model.pt")
    with pytest.raises(tg.CheckpointFormatError, match="checkpoint format 1, this one reads 2.*0123abcd"):
        tg.read_checkpoint_file(tmp_path / "model.pt")
    torch.save({**saved, "format": tg.CHECKPOINT_FORMAT}, tmp_path / "model.pt")
    assert tg.read_checkpoint_file(tmp_path / "model.pt")["step"] == 4



def test_a_checkpoint_from_before_a_model_field_existed_is_refused_naming_the_field(tiny_args, tmp_path):
    """A model field added after a checkpoint was written (its stored args lack it): refused in one line naming
    the field, not a KeyError."""
    run = tg.train(tiny_args(num_iterations=2, val_every=0, save_every=2, run_id="m", checkpoint_dir=str(tmp_path)))
    meta = torch.load(Path(run.checkpoint) / "model.pt", weights_only=True)
    del meta["args"]["model_dim"]
    torch.save(meta, Path(run.checkpoint) / "model.pt")
    with pytest.raises(ValueError, match="different model: model_dim: not a field when the checkpoint was written"):
        tg.load_checkpoint(Path(run.checkpoint), None, [], tiny_args(), 0, 1, print)

if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    PINNED.write_text(json.dumps({name: resolved(name) for name in tg.PRESETS}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED}")
