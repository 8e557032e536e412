#!/usr/bin/env bash
# --preset medium on one GPU (device tool, nvidia-h100-x1): GPT-2-medium size (24 x 1024, 16 heads)
# for 100 steps with a checkpoint at step 50, then a second process resumed from that checkpoint.
# Proxy corpus in .carry/ as for gpu_proof_1gpu.sh. Logs go to the folder given (default $OUT).
# The whole script runs ~12 minutes, over one device call's limit, so it was started detached:
#   mkdir -p /tmp/p && setsid nohup bash bench/gpu_proof_medium.sh /tmp/p >/tmp/p/out.txt 2>&1 </dev/null &
# and read back by later calls (cat /tmp/p/out.txt; cp /tmp/p/*.txt "$OUT/").
set -u
export PYTHONUNBUFFERED=1
DEST="${1:-$OUT}"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
PROXY="--train_files .carry/fineweb_train_*.bin --val_files .carry/fineweb_val_*.bin --val_tokens 917504"
COMMON="--preset medium $PROXY --num_iterations 100 --val_every 50 --warmup_steps 1 --log_every 10"
python3 train_gpt.py $COMMON --save_every 50 --run_id h100_medium_100 2>&1 \
  | grep -E -v "^step:[0-9]+/100 train_time" | grep -v -i warn
python3 train_gpt.py $COMMON --resume checkpoints/h100_medium_100/step_000050 --run_id h100_medium_resumed 2>&1 \
  | grep -E -v "^step:[0-9]+/100 train_time" | grep -v -i warn
cp logs/h100_medium_100.txt logs/h100_medium_resumed.txt "$DEST/"
echo "medium proof done"
