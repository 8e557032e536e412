#!/usr/bin/env bash
# Proof on one GPU (device tool): kernel tests on the GPU, the step-time benchmark at ws=3 (with a
# profile), then the full-size model on the proxy corpus (shards made by data/tokenize.py from
# ../shared/data/proxy, carried in .carry/) as a background job, so it outlives one 10-minute
# command: poll /tmp/job/full.txt, the log lands in logs/h100_proxy_300.txt.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q tests/test_kernels.py 2>&1 | tail -1
python3 bench/step_time.py --ws 3 --steps 10 --profile --train_files ".carry/fineweb_train_*.bin" 2>&1 \
  | grep -v -i warn | cut -c1-90,150-250 | head -40
mkdir -p /tmp/job
PROXY="--train_files .carry/fineweb_train_*.bin --val_files .carry/fineweb_val_*.bin --val_tokens 983040"
setsid nohup bash -c "python3 train_gpt.py $PROXY --num_iterations 300 --val_every 50 --run_id h100_proxy_300 > /tmp/job/full.txt 2>&1; echo \$? > /tmp/job/rc" > /dev/null 2>&1 &
echo "full-size run started"
