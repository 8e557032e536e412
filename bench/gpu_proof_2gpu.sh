#!/usr/bin/env bash
# Multi-GPU proof (two H200s): the full-size model on the proxy corpus in DATA_DIR through run.sh
# (torchrun, 2 processes, 4 accumulation steps each): the distributed optimizers and data split. Its
# losses should match the 1-GPU run's at equal steps (bench/README.md). The log goes to RESULTS_DIR.
#   DATA_DIR=/path/to/shards RESULTS_DIR=/path/to/results bash bench/gpu_proof_2gpu.sh
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
NPROC=2 ./run.sh "${PROXY[@]}" --num_iterations 300 --val_every 50 --run_id h200x2_proxy_300 2>&1 \
  | grep -E -v "^step:[0-9]+/300 train_time" | grep -v -i warn
grep -E "^step:(100|200|300)/300 train" logs/h200x2_proxy_300.txt
cp logs/h200x2_proxy_300.txt "$RESULTS_DIR/"
