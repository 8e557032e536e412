#!/usr/bin/env bash
# Proof on one GPU (device tool, nvidia-h100-x1): the kernel tests on the GPU, the step-time
# benchmark at ws=3, then the full-size model for 300 steps on the proxy corpus (shards made by
# data/tokenize_corpus.py from ../shared/data/proxy, carried in .carry/). Add --profile to the benchmark
# line to see the top kernels.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q tests/test_kernels.py 2>&1 | tail -1
python3 bench/step_time.py --ws 3 --steps 10 --train_files ".carry/fineweb_train_*.bin" 2>&1 | grep -v -i warn
PROXY="--train_files .carry/fineweb_train_*.bin --val_files .carry/fineweb_val_*.bin --val_tokens 917504"
python3 train_gpt.py $PROXY --num_iterations 300 --val_every 50 --run_id h100_proxy_300 2>&1 \
  | grep -E -v "^step:[0-9]+/300 train_time" | grep -v -i warn
grep -E "^step:(100|200|300)/300 train" logs/h100_proxy_300.txt
cp logs/h100_proxy_300.txt "$OUT/"
