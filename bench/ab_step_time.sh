#!/usr/bin/env bash
# A/B step time on one GPU (device tool): an older train_gpt.py against the working tree's, run
# alternately (old, new, old, new) on the same machine, 20 timed steps each at ws=3. Each version
# gets its own inductor cache: with a shared one, a version whose custom op's backward formula
# differs can be handed the other's cached backward graph (seen here: an argument-count error).
#   here:   git show REV:train_gpt.py > .carry/old_train_gpt.py
#   device: bash bench/ab_step_time.sh .carry/old_train_gpt.py     (carry .carry)
set -u
export PYTHONUNBUFFERED=1
R=$PWD
mkdir -p /tmp/old/bench && cp "$1" /tmp/old/train_gpt.py && cp bench/step_time.py /tmp/old/bench/
nvidia-smi -L
for v in old new old new; do
  if [ $v = old ]; then d=/tmp/old; else d=$R; fi
  (cd $d && TORCHINDUCTOR_CACHE_DIR=/tmp/cache_$v python3 bench/step_time.py --ws 3 --steps 20 \
     --train_files "$R/.carry/fineweb_train_*.bin" 2>&1 | grep -E "^step of|Error" | sed "s/^/$v: /")
done
