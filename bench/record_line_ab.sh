#!/usr/bin/env bash
# A/B of the public record line's techniques (issue 12) on the development protocol's 200-step schedule:
# ours with the 09/03 algorithm ("base") against today's record preset and the techniques still open,
# two seeds each, four runs sharing the GPU at a time (val losses at equal steps; step times mean
# nothing there, see bench/step_time.py for those). No public runs: the public code's own 200-step
# curve is in bench/results/fidelity_0903_h100.md; its final val loss, 2.980 (mean of two runs), is the
# --target whose tokens and time each run's table reports. Results of the earlier rounds: bench/README.md.
#
#   bash bench/record_line_ab.sh PUBLIC_CHECKOUT SHARD_DIR OUT_DIR [more --variant NAME "FLAGS" ...]
#
# The batch-size stages change the tokens per step: bench/token_budget_ab.sh compares at equal tokens.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
public=$1 shards=$2 out=$3
shift 3
cd "$(dirname "$0")/.."
python3 bench/side_by_side.py --public_code 0903 --public "$public" --train_files "$shards/fineweb_train_*.bin" \
    --val_files "$shards/fineweb_val_*.bin" --batch_size 131072 --val_tokens 983040 --val_seq_len 40960 \
    --val_every 50 --steps 200 --seeds 0 1 --public_seeds --parallel --max_parallel 4 --work /tmp/record_line_ab \
    --label base --target 2.980 \
    --variant record "--preset record" \
    --variant normuon "--muon_beta2 0.9" \
    --variant record_normuon "--preset record --muon_beta2 0.9" \
    --variant yarn "--yarn true --attn_scale 0.1 --final_val_window 13" \
    --variant smear "--smear true" \
    --variant ve_gate "--ve_gate true" \
    --variant key_offset "--key_offset true" \
    --variant doc_len "--doc_len_schedule 896,2048,2048" \
    "$@" --out "$out/record_line_200.md"
