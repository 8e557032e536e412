#!/usr/bin/env bash
# The record preset as run.sh runs it, cut to 80 steps (every stage boundary and the extension crossed), on one GPU
# and then on two when two are visible: each stage's step time from the run's summary lines, the warm-up's time, the
# peak memory, the final validation, and the logs in RESULTS_DIR. Extra arguments go to train_gpt.py (e.g.
# --attention fa4). Proxy shards in DATA_DIR (bench/gpu_env.sh); a cold compile takes minutes before the first step.
# NPROCS picks the GPU counts (default "1 2"; a count over the GPUs nvidia-smi lists is skipped).
#   DATA_DIR=/path/to/shards RESULTS_DIR=/path/to/results [NPROCS=2] bash bench/record_80_proof.sh [--attention fa4]
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
gpus=$(nvidia-smi -L | grep -c '^GPU [0-9]')
for n in ${NPROCS:-1 2}; do
  (( n > gpus )) && { echo "NPROC=$n: skipped, $gpus GPU(s) listed"; continue; }
  id="record80_${n}gpu_$(date +%Y%m%d_%H%M%S)"
  echo "NPROC=$n ./run.sh --num_iterations 80 ($id):"
  NPROC=$n ./run.sh "${PROXY[@]}" --num_iterations 80 --val_every 0 --run_id "$id" "$@" 2>&1 \
    | grep -E "^(stage |ext|finished|device:|warm-up: shape|warm-up \(compile\)|peak memory)|val_loss:|error" \
    | grep -v -i warn
  cp "logs/$id.txt" "$RESULTS_DIR/"
done
