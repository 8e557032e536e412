#!/usr/bin/env bash
# Run management on one GPU (an H100): a preset (single or medium) for 100 steps with a checkpoint
# at step 50, then a second process resumed from that checkpoint; their losses after step 50 should
# agree (bench/README.md). Proxy corpus in DATA_DIR as for gpu_proof_1gpu.sh; logs to RESULTS_DIR.
#   DATA_DIR=/path/to/shards RESULTS_DIR=/path/to/results bash bench/gpu_proof_run_management.sh single
# medium takes ~12 minutes, so start it detached, then poll its output and logs/ until it prints
# "medium proof done" (bench/CONTRIBUTING_GPU.md):
#   mkdir -p /tmp/p && DATA_DIR=... RESULTS_DIR=/tmp/p setsid nohup bash bench/gpu_proof_run_management.sh medium \
#       >/tmp/p/out.txt 2>&1 </dev/null &
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -u
PRESET="${1:-single}"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
COMMON=(--preset "$PRESET" "${PROXY[@]}" --num_iterations 100 --val_every 50 --warmup_steps 1 --log_every 10)
python3 train_gpt.py "${COMMON[@]}" --save_every 50 --run_id "h100_${PRESET}_100" 2>&1 \
  | grep -E -v "^step:[0-9]+/100 train_time" | grep -v -i warn
python3 train_gpt.py "${COMMON[@]}" --resume "checkpoints/h100_${PRESET}_100/step_000050" --run_id "h100_${PRESET}_resumed" 2>&1 \
  | grep -E -v "^step:[0-9]+/100 train_time" | grep -v -i warn
cp "logs/h100_${PRESET}_100.txt" "logs/h100_${PRESET}_resumed.txt" "$RESULTS_DIR/"
echo "$PRESET proof done"
