#!/usr/bin/env bash
# Checkpoints and SIGTERM on two GPUs (two H200s), through run.sh (torchrun, NCCL, 2 processes x 4
# accumulation steps), full-size model on the proxy corpus in DATA_DIR:
#   A: 60 steps uninterrupted, a checkpoint every 20;
#   B: resumed from A's step-20 checkpoint; SIGTERM to torchrun once step 30 is logged (torchrun
#      forwards it to both workers: they finish the step, save, exit);
#   C: resumed from B's checkpoint to step 60.
# B's and C's losses should follow A's (bench/README.md). The three logs go to RESULTS_DIR.
#   DATA_DIR=/path/to/shards RESULTS_DIR=/path/to/results bash bench/gpu_proof_2gpu_resume.sh
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
COMMON=("${PROXY[@]}" --num_iterations 60 --val_every 30 --warmup_steps 1 --log_every 5)
rm -rf logs/h200x2_[abc].txt checkpoints/h200x2_[abc] b.out  # a clean start when run again
quiet() { grep -E -v "^step:[0-9]+/60 train_time" | grep -v -i warn; }

NPROC=2 ./run.sh "${COMMON[@]}" --save_every 20 --run_id h200x2_a 2>&1 | quiet

NPROC=2 ./run.sh "${COMMON[@]}" --resume checkpoints/h200x2_a/step_000020 --run_id h200x2_b >b.out 2>&1 &
launcher=$!
until grep -q "^step:3[0-9]/60 train_time" logs/h200x2_b.txt 2>/dev/null; do
  kill -0 $launcher 2>/dev/null || { echo "B ended before step 30"; break; }
  sleep 0.5
done
echo "sending SIGTERM to torchrun (pid $launcher)"
kill -TERM $launcher
wait $launcher; echo "B: torchrun exit status $?"
quiet <b.out | grep -v "^    "
resume="$(grep "^stopped by signal" logs/h200x2_b.txt | awk "{print \$NF}")"
echo "B left: ${resume:-no checkpoint}"

NPROC=2 ./run.sh "${COMMON[@]}" --resume "$resume" --run_id h200x2_c 2>&1 | quiet
grep -E "^(step:[0-9]+/60 (val_loss|train_loss)|stopped|resumed at)" logs/h200x2_[abc].txt
cp logs/h200x2_a.txt logs/h200x2_b.txt logs/h200x2_c.txt "$RESULTS_DIR/"
