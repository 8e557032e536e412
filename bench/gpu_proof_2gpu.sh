#!/usr/bin/env bash
# Multi-GPU proof (device tool, nvidia-h200-x2): the full-size model on the proxy corpus through
# run.sh (torchrun, 2 processes, 4 accumulation steps each): the distributed optimizers and data
# split. Its losses should match the 1-GPU run's at equal steps (bench/README.md).
set -u
export PYTHONUNBUFFERED=1
nvidia-smi -L
export PATH="$(dirname "$(python3 -c "import sys; print(sys.executable)")"):$PATH"  # torchrun beside python3
PROXY="--train_files .carry/fineweb_train_*.bin --val_files .carry/fineweb_val_*.bin --val_tokens 917504"
NPROC=2 ./run.sh $PROXY --num_iterations 300 --val_every 50 --run_id h200x2_proxy_300 2>&1 \
  | grep -E -v "^step:[0-9]+/300 train_time" | grep -v -i warn
grep -E "^step:(100|200|300)/300 train" logs/h200x2_proxy_300.txt
cp logs/h200x2_proxy_300.txt "$OUT/"
