#!/usr/bin/env bash
# A/B step time on one GPU: an older train_gpt.py against the working tree's, run alternately (old,
# new, old, new) on the same machine, 20 timed steps each at ws=3, on the training shards in
# DATA_DIR (bench/gpu_env.sh). Each version gets its own inductor cache: with a shared one, a version
# whose custom op's backward formula differs can be handed the other's cached backward graph (seen
# here: an argument-count error).
#   git show REV:train_gpt.py > old_train_gpt.py      # then copy it to the GPU machine with the repository
#   (a kernels.py beside OLD_TRAIN_GPT_PY goes with it: git show REV:kernels.py; else the working tree's;
#   likewise data/shards.py beside it: git show REV:data/shards.py > data/shards.py there)
#   DATA_DIR=/path/to/shards bash bench/ab_step_time.sh old_train_gpt.py
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -u
if [ $# -ne 1 ] || [ ! -f "$1" ]; then
  echo "usage: DATA_DIR=/path/to/shards bash bench/ab_step_time.sh OLD_TRAIN_GPT_PY" >&2
  exit 2
fi
OLD="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"  # before gpu_env.sh moves to the repository root
source "$(dirname "$0")/gpu_env.sh"
R=$PWD
mkdir -p /tmp/old/bench && cp "$OLD" /tmp/old/train_gpt.py && cp bench/step_time.py /tmp/old/bench/
if [ -f "$(dirname "$OLD")/kernels.py" ]; then cp "$(dirname "$OLD")/kernels.py" /tmp/old/; else cp kernels.py /tmp/old/; fi
mkdir -p /tmp/old/data  # the shard format the trainer imports (data/shards.py)
if [ -f "$(dirname "$OLD")/data/shards.py" ]; then cp "$(dirname "$OLD")/data/shards.py" /tmp/old/data/; else cp data/shards.py /tmp/old/data/; fi
nvidia-smi -L
for v in old new old new; do
  if [ $v = old ]; then d=/tmp/old; else d=$R; fi
  (cd $d && TORCHINDUCTOR_CACHE_DIR=/tmp/cache_$v python3 bench/step_time.py --ws 3 --steps 20 \
     --train_files "$DATA_DIR/fineweb_train_*.bin" 2>&1 | grep -E "^step of|Error" | sed "s/^/$v: /")
done
