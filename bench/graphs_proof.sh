#!/usr/bin/env bash
# The forward/backward graph runners (--cuda_graphs, train_gpt.GraphRunner) on one GPU, and on two if two are
# visible: the GPU tests; the record step at window 11 with the same seed from the same start for 80 steps, the usual
# launch then the runners, each alone in its process (their loss sums must agree within the run-to-run spread: run
# the pair twice to see it); the usual launch against the runners in turns in one process (bench/step_time.py
# --graphs_ab), with the Python and with the C++ wrapper; on two GPUs, one 49,152-token micro-batch each (the 8-GPU
# record's per-GPU shape), the step and its exposed communication with and without the runners
# (bench/comm_time.py), with them and Muon's collectives in bf16 (--muon_bf16_comm), and with both and the tables'
# Adam every fourth step (--table_adam_every 4,0.28; the profiled 8 steps hold two of the tables'). Shards in DATA_DIR
# (bench/gpu_env.sh); the printed lines are the results. PARTS picks parts (default all: tests twin turns comm); the
# twin's four runs take about 10 minutes on one H200 with a warm compile cache, the C++ wrapper's first compile
# about 5 more.
#   DATA_DIR=/path/to/shards [PARTS="twin turns"] bash bench/graphs_proof.sh [--attention fa4]
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -u
source "$(dirname "$0")/gpu_env.sh"
EXTRA=("$@")  # e.g. --attention fa4
PARTS=" ${PARTS:-tests twin turns comm} "
STEP=(--ws 11 --preset record --train_files "$DATA_DIR/fineweb_train_*.bin" --val_files "$DATA_DIR/fineweb_val_*.bin"
      "${EXTRA[@]}")
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
[[ $PARTS == *" tests "* ]] && python3 -m pytest -q tests/test_cuda_graphs.py tests/test_train.py -k gpu \
  -p no:cacheprovider 2>&1 | tail -1
[[ $PARTS == *" twin "* ]] && for round in 1 2; do
  for graphs in false true; do
    echo "same seed, 80 steps, --cuda_graphs $graphs (round $round):"
    python3 bench/step_time.py --steps 80 --cpp_wrapper false --cuda_graphs "$graphs" "${STEP[@]}" 2>&1 \
      | grep -E "^ws=11:"
  done
done
[[ $PARTS == *" turns "* ]] && for wrapper in false true; do
  echo "in turns, --cpp_wrapper $wrapper:"
  python3 bench/step_time.py --steps 30 --rounds 3 --graphs_ab --cpp_wrapper "$wrapper" "${STEP[@]}" 2>&1 \
    | grep -E "^swap"
done
if [[ $PARTS == *" comm "* ]] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  for flags in "--cuda_graphs false" "--cuda_graphs true" "--cuda_graphs true --muon_bf16_comm true" \
               "--cuda_graphs true --muon_bf16_comm true --table_adam_every 4,0.28"; do
    echo "two GPUs, one micro-batch each, $flags:"
    # shellcheck disable=SC2086  # the flags split into words on purpose
    torchrun --standalone --nproc_per_node=2 bench/comm_time.py --steps 10 --stage -1 --batch_size 98304 \
      $flags --preset record --train_files "$DATA_DIR/fineweb_train_*.bin" "${EXTRA[@]}" 2>&1 \
      | grep -E "^(device|rank|  [0-9])"
  done
fi
