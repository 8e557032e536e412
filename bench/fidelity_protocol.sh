#!/usr/bin/env bash
# The development protocol for any change that can alter learning: the public 2025-09-03 record's own
# code and ours side by side on one GPU (bench/side_by_side.py --public_code 0903), on a held-out corpus.
#
#   bash bench/fidelity_protocol.sh PUBLIC_CHECKOUT SHARD_DIR OUT_DIR [harness flags for ours...]
#
# PUBLIC_CHECKOUT: a checkout of KellerJordan/modded-nanogpt. SHARD_DIR: fineweb_val_000000.bin (at
# least 983,042 tokens) and fineweb_train_*.bin, e.g. made by `python data/tokenize_corpus.py ... --out SHARD_DIR`.
# Batch 131,072 tokens = 8 x 16,384; validation: 983,040 tokens in buffers of 40,960 (the public
# definition, scaled down). Two schedules:
#   400 steps, validation every 50: the public code with seeds 0 and 1, then ours with seeds 0 and 1,
#       one after the other (so ms/step compares too)                    -> OUT_DIR/fidelity_400.md
#   200 steps, run to the end of their cooldown: the same four runs sharing the GPU (val losses
#       only); the public final val loss is the target that record-line changes must reach in
#       fewer tokens                                                      -> OUT_DIR/fidelity_200.md
# Both schedules share one work folder, so the second reuses the first's compile caches.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
public=$1 shards=$2 out=$3
shift 3
cd "$(dirname "$0")/.."
common=(--public "$public" --train_files "$shards/fineweb_train_*.bin" --val_files "$shards/fineweb_val_*.bin"
        --batch_size 131072 --val_tokens 983040 --val_seq_len 40960 --val_every 50 --seeds 0 1 --public_seeds 0 1 --work /tmp/side_by_side_0903 "$@")
python3 bench/side_by_side.py --public_code 0903 "${common[@]}" --steps 400 --out "$out/fidelity_400.md"
python3 bench/side_by_side.py --public_code 0903 "${common[@]}" --steps 200 --parallel --out "$out/fidelity_200.md"
