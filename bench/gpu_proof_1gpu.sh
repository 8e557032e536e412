#!/usr/bin/env bash
# Proof on one GPU (an H100): the kernel tests on the GPU, the step-time benchmark at ws=3, then the
# full-size model for 300 steps on the proxy corpus (shards made by data/tokenize_corpus.py, in
# DATA_DIR); the run's log is copied to RESULTS_DIR (bench/gpu_env.sh, bench/CONTRIBUTING_GPU.md).
# Add --profile to the benchmark line to see the top kernels.
#   DATA_DIR=/path/to/shards RESULTS_DIR=/path/to/results bash bench/gpu_proof_1gpu.sh
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q tests/test_kernels.py 2>&1 | tail -1
python3 bench/step_time.py --ws 3 --steps 10 --train_files "$DATA_DIR/fineweb_train_*.bin" 2>&1 | grep -v -i warn
python3 train_gpt.py "${PROXY[@]}" --num_iterations 300 --val_every 50 --run_id h100_proxy_300 2>&1 \
  | grep -E -v "^step:[0-9]+/300 train_time" | grep -v -i warn
grep -E "^step:(100|200|300)/300 train" logs/h100_proxy_300.txt
cp logs/h100_proxy_300.txt "$RESULTS_DIR/"
