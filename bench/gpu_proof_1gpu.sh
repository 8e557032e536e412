#!/usr/bin/env bash
# Proof on one GPU (device tool): kernel tests, a tiny compiled run, then the full-size model on the
# proxy corpus (shards made by data/tokenize.py from ../shared/data/proxy, carried in .carry/) in the
# background, so it outlives one 10-minute command. Poll with: tail /tmp/job/full.txt
set -u
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q tests/test_kernels.py 2>&1 | tail -3
PROXY="--train_files .carry/fineweb_train_*.bin --val_files .carry/fineweb_val_*.bin --val_tokens 983040"
python3 train_gpt.py $PROXY --num_layers 4 --model_dim 256 --num_heads 2 --window_pattern LSSL \
  --no_attn_layers 2 --num_value_embeds 1 --seq_len 8192 --batch_size 65536 --val_seq_len 65536 \
  --num_iterations 30 --val_every 10 --warmup_steps 1 --run_id tiny_gpu 2>&1 | grep -v "^step:[0-9]*/30 train" | tail -15
mkdir -p /tmp/job
setsid nohup bash -c "python3 train_gpt.py $PROXY --num_iterations 300 --val_every 50 --run_id h100_proxy_300 > /tmp/job/full.txt 2>&1; echo \$? > /tmp/job/rc" > /dev/null 2>&1 &
echo "full-size run started"
