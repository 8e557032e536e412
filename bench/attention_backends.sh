#!/usr/bin/env bash
# Hopper attention backends (FlashAttention-3, FlashAttention-4, PyTorch varlen) on one H100, in one
# session: the GPU numerics tests of every installed backend, ms per step at ws 3, 7 and 11 for
# varlen, fa4 and fa3 (bench/step_time.py), then a compiled 20-step run of the record configuration
# with --attention fa4, fa3 and auto. Install both libraries first (README: Hopper attention); DATA_DIR and
# RESULTS_DIR as in bench/gpu_env.sh; the 20-step logs are copied to RESULTS_DIR.
#   DATA_DIR=/path/to/shards RESULTS_DIR=/path/to/results bash bench/attention_backends.sh
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import train_gpt as tg, torch; print('installed:', tg.available_attention_backends(torch.device('cuda')))"
python3 -m pytest -q tests/test_attention_gpu.py 2>&1 | tail -4
for a in varlen fa4 fa3; do
  echo "--- step_time.py --attention $a"
  python3 bench/step_time.py --ws 3 7 11 --steps 10 --attention $a --train_files "$DATA_DIR/fineweb_train_*.bin" 2>&1 \
    | grep -E "^device|^ws=|[Ee]rror" | grep -v -i warn
done
for a in fa4 fa3 auto; do
  echo "--- train_gpt.py --attention $a --num_iterations 20"
  python3 train_gpt.py "${PROXY[@]}" --num_iterations 20 --val_every 10 --attention $a --run_id attention_$a 2>&1 \
    | grep -E "^attention|attention backend|^step:(10|20)/20 val|[Ee]rror" | grep -v -i warn
  cp logs/attention_$a.txt "$RESULTS_DIR/"
done
