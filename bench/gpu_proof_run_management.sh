#!/usr/bin/env bash
# Run management on one GPU (device tool, nvidia-h100-x1): --preset single for 100 steps with a
# checkpoint at step 50, then a second process resumed from that checkpoint; their losses after
# step 50 should agree (bench/README.md). Proxy corpus in .carry/ as for gpu_proof_1gpu.sh.
set -u
export PYTHONUNBUFFERED=1
PROXY="--train_files .carry/fineweb_train_*.bin --val_files .carry/fineweb_val_*.bin --val_tokens 917504"
COMMON="--preset single $PROXY --num_iterations 100 --val_every 50 --warmup_steps 1 --log_every 10"
python3 train_gpt.py $COMMON --save_every 50 --run_id h100_single_100 2>&1 \
  | grep -E -v "^step:[0-9]+/100 train_time" | grep -v -i warn
python3 train_gpt.py $COMMON --resume checkpoints/h100_single_100/step_000050 --run_id h100_single_resumed 2>&1 \
  | grep -E -v "^step:[0-9]+/100 train_time" | grep -v -i warn
cp logs/h100_single_100.txt logs/h100_single_resumed.txt "$OUT/"
