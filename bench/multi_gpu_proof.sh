#!/usr/bin/env bash
# One GPU against two, on a machine with two GPUs of one kind: the record configuration (full-size
# model, the record preset) for 60 steps on the shards in DATA_DIR, through run.sh.
#   1. one:   1 GPU (CUDA_VISIBLE_DEVICES=0), 8 accumulation steps; a checkpoint at step 30.
#   2. two:   2 GPUs, 4 accumulation steps each; the same tokens per step (equivalence, ms/step);
#      bench/curves.py prints both per-step loss curves and their differences.
#   3. two_resumed: two's step-30 checkpoint resumed on 2 GPUs; two_on_one: the same on 1 GPU
#      (the optimizer shards re-split).
#   4. bench/optimizer_time.py on 1 and on 2 GPUs: per-rank optimizer times.
#   5. bench/failure_drill.py on 2 GPUs, smoke preset: the last rank's loss NaN / the rank hangs /
#      the rank dies at step 4; every rank must stop (a hang: within about 2 x --collective_timeout_s).
# Logs and the drill outputs go to RESULTS_DIR; bench/README.md reads them.
#   DATA_DIR=/path/to/shards RESULTS_DIR=/path/to/results bash bench/multi_gpu_proof.sh
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
COMMON=("${PROXY[@]}" --num_iterations 60 --val_every 20 --warmup_steps 1 --log_every 10)
rm -rf logs/{one,two,two_resumed,two_on_one}.txt checkpoints/{one,two,two_resumed,two_on_one,drill_*}  # a clean start
quiet() { grep -E -v "^step:[0-9]+/60 train_time" | grep -v -i warn; }
summary() { grep -E "^(step:[0-9]+/60 (val_loss|train_loss)|finished|resumed at|note:)" "logs/$1.txt"; }

CUDA_VISIBLE_DEVICES=0 NPROC=1 ./run.sh "${COMMON[@]}" --save_every 30 --run_id one 2>&1 | quiet
NPROC=2 ./run.sh "${COMMON[@]}" --save_every 30 --run_id two 2>&1 | quiet
CUDA_VISIBLE_DEVICES=0 NPROC=1 ./run.sh "${COMMON[@]}" --resume checkpoints/two/step_000030 --run_id two_on_one 2>&1 | quiet
NPROC=2 ./run.sh "${COMMON[@]}" --resume checkpoints/two/step_000030 --run_id two_resumed 2>&1 | quiet
for r in one two two_on_one two_resumed; do echo "== $r"; summary $r; cp "logs/$r.txt" "$RESULTS_DIR/"; done
python3 bench/curves.py logs/one.txt logs/two.txt | tee "$RESULTS_DIR/curves_one_two.md"

for n in 1 2; do
  torchrun --standalone --nproc_per_node=$n bench/optimizer_time.py 2>&1 | grep -v -i warn | tee "$RESULTS_DIR/optimizer_time_x$n.txt"
done

DRILL=(--preset smoke --num_iterations 10 --val_every 0 --save_every 2 --collective_timeout_s 30)
for failure in nan hang exit; do
  start=$(date +%s)
  torchrun --standalone --nproc_per_node=2 bench/failure_drill.py $failure 4 "${DRILL[@]}" --run_id drill_$failure \
    >"$RESULTS_DIR/drill_$failure.txt" 2>&1
  status=$?
  echo "drill $failure: torchrun exit status $status after $(( $(date +%s) - start )) s; checkpoints:" \
       $(ls checkpoints/drill_$failure) | tee -a "$RESULTS_DIR/drill_$failure.txt"
  grep -E "^step:[0-9]+/10 train_time|failure_drill|error|checkpoint:" "$RESULTS_DIR/drill_$failure.txt" | head -12
done
