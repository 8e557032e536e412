"""Every preset resolves to the run it resolved to when tests/data/presets_pinned.json was written: each
hyperparameter, and the schedule as training_stages makes it (steps, batch, micro-batch, document cut,
windows, lr, multi-token prediction, prefix-token loss). A change that means to alter a preset rewrites the file with
`python tests/test_presets.py --write` and shows the difference in its diff."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest

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
    stages = [[st.start, st.end, st.batch.batch_size, st.batch.seq_len, st.batch.max_doc_len, list(st.windows),
               list(st.prefix), st.lr_mult, [list(m) for m in st.mtp]] for st in tg.training_stages(args)]
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
    rows = tg.RECORD_LINE["stages"]
    monkeypatch.setitem(tg.RECORD_LINE, "stages", (dataclasses.replace(rows[0], doc_len=1024), *rows[1:]))
    with pytest.raises(AssertionError):
        test_every_preset_resolves_to_its_pinned_run("record")


def test_the_public_line_preset_is_the_record_with_the_public_techniques_on():
    """Each technique the record preset leaves off is on in public-line, which differs from record in nothing else."""
    import torch
    record, public = tg.parse_args(["--preset", "record"]), tg.parse_args(["--preset", "public-line"])
    differ = {f.name for f in dataclasses.fields(tg.Hyperparameters) if getattr(record, f.name) != getattr(public, f.name)}
    assert differ == {"preset", "stages", "muon_beta2", "muon_weight_decay", "xsa", "yarn", "smear", "ve_gate",
                      "paired_head_blocks", "head_adam_betas", "head_weight_decay", "tied_embed_stages",
                      "extension_steps", "extension_window", "final_lr_frac", "final_val_window", "mudd", "parallel_attn", "adam_every", "num_value_embeds", "value_embed_blocks",
                      "uniform_out_init", "muon_lr", "mlp_muon_lr_mults", "muon_momentum_start", "muon_momentum",
                      "muon_momentum_cooldown", "scalar_adam_betas",
                      "embed_weight_decay"}
    assert [row.mtp for row in public.stages] == [(0.5, 0.25), (0.5, 0.0), (0.0, 0.0)]
    assert [row.prefix for row in public.stages] == [0.25, 0.25, 0.0]
    assert [dataclasses.replace(row, mtp=(), prefix=0.0) for row in public.stages] == list(record.stages)
    with torch.device("meta"):
        model = tg.GPT(tg.ModelConfig.from_args(public))
    assert model.smear_w is not None and any(b.attn is not None and b.attn.ve_gate_w is not None for b in model.blocks)


def test_a_checkpoint_with_a_deleted_field_resumes_where_it_was_off_and_is_refused_where_on():
    saved = {k: list(v) if isinstance(v, tuple) else v
             for k, v in dataclasses.asdict(tg.parse_args(["--preset", "record"])).items() if k != "stages"}
    for name, off in tg.REMOVED_FIELDS.items():
        assert not hasattr(tg.Hyperparameters(), name)  # deleted from the dataclass
        assert tg.Hyperparameters(**tg.stored_args({**saved, name: list(off)}))  # as written by json/torch: a list
        with pytest.raises(ValueError, match=f"trained with {name}=0, a technique this train_gpt.py no longer has"):
            tg.stored_args({**saved, name: [0]})


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    PINNED.write_text(json.dumps({name: resolved(name) for name in tg.PRESETS}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED}")
