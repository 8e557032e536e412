"""EXPERIMENT (branch wt68): MASTER_FINAL_DIAG logs the final validation as records #89 and ANVIL2 run it (the long
window raised without a YaRN step, the short window kept) beside ours, on the same shipped weights."""
import re

import train_gpt as tg
from conftest import FAST


def test_the_diagnostic_validates_the_same_weights_with_the_masters_final_windows(tiny_args, monkeypatch):
    monkeypatch.setenv("MASTER_FINAL_DIAG", "1")
    args = tiny_args(**FAST, num_iterations=6, val_every=0, final_val_window=5)
    run = tg.train(args)
    log = open(run.log_path).read()
    ours = float(re.search(r"step:6/6 val_loss:([\d.]+)", log).group(1))
    diag = re.search(r"step:6/6 val_loss_master_final:([\d.]+) \(untimed diagnostic: windows (\d+)/(\d+) tokens, "
                     r"rotary tables of (\d+)\)", log)
    assert diag, log[-2000:]
    last = tg.Schedule(args).val_windows(5)
    assert (int(diag.group(2)), int(diag.group(3)), int(diag.group(4))) == (
        tg.window_tokens(args.final_val_window, args.window_block)[0], last[1], last[0])
    assert float(diag.group(1)) != ours and abs(float(diag.group(1)) - ours) < 0.5  # other windows, same weights
