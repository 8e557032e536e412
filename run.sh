#!/usr/bin/env bash
# Launch the speedrun on this machine's NVIDIA GPUs:
#   ./run.sh [--field value ...]       arguments go to train_gpt.py
#   NPROC=4 ./run.sh                   on 1, 2, 4 or 8 GPUs (default 8); gradient accumulation
#                                      keeps the global batch the same
# Checks the GPU count with `nvidia-smi -L` first, then what PyTorch sees (PYTHON, default python3),
# so a wrong machine or a PyTorch build that cannot use its GPUs fails in seconds, not after a compile.
set -euo pipefail
cd "$(dirname "$0")"

NPROC="${NPROC:-8}"
case "$NPROC" in
  1|2|4|8) ;;
  *) echo "run.sh: error: NPROC=$NPROC: train_gpt.py runs on 1, 2, 4 or 8 GPUs" >&2; exit 1 ;;
esac

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  if listing="$(nvidia-smi -L 2>/dev/null)"; then
    gpus="$(printf '%s\n' "$listing" | grep -c '^GPU [0-9]' || true)"
  fi
fi
# CUDA_VISIBLE_DEVICES narrows what the processes can see (nvidia-smi ignores it)
if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
  visible="$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c '[^[:space:]]' || true)"
  (( visible < gpus )) && gpus="$visible"
fi

if (( gpus == 0 )); then
  echo "run.sh: error: no NVIDIA GPU found (nvidia-smi is missing, failed or lists no GPU, or" \
       "CUDA_VISIBLE_DEVICES hides them); the speedrun needs NVIDIA GPUs (8xH100 for the record)." \
       "On the CPU, run the tiny smoke test instead: python train_gpt.py --preset smoke" >&2
  exit 1
fi
if (( gpus < NPROC )); then
  fit=1
  for n in 8 4 2; do (( n <= gpus )) && { fit=$n; break; }; done
  echo "run.sh: error: NPROC=$NPROC but only $gpus NVIDIA GPU(s) found; run on what is here with" \
       "NPROC=$fit ./run.sh (gradient accumulation keeps the global batch)" >&2
  exit 1
fi

if ! command -v torchrun >/dev/null 2>&1; then
  echo "run.sh: error: torchrun not found: install PyTorch first (pip install -r requirements.txt)" >&2
  exit 1
fi
# PyTorch's own view: a CPU-only build, or a CUDA build newer than the driver, sees none of the GPUs
# nvidia-smi lists
PYTHON="${PYTHON:-python3}"
if ! seen="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)"; then
  echo "run.sh: error: $PYTHON cannot import torch: install PyTorch first (pip install -r requirements.txt)" >&2
  exit 1
fi
if (( seen == 0 )); then
  reason="$("$PYTHON" -c 'import train_gpt; print(train_gpt.no_gpu_reason())' 2>/dev/null)" || reason="no usable GPU"
  echo "run.sh: error: $reason (nvidia-smi lists $gpus GPU(s))" >&2
  exit 1
fi
if (( seen < NPROC )); then
  echo "run.sh: error: NPROC=$NPROC but PyTorch sees only $seen GPU(s) of the $gpus nvidia-smi lists" >&2
  exit 1
fi
exec torchrun --standalone --nproc_per_node="$NPROC" train_gpt.py "$@"
