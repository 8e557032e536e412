# Sourced by the GPU scripts in bench/ (gpu_proof_*.sh, multi_gpu_proof.sh, ab_step_time.sh, attention_backends.sh); not run on its own.
# Two environment variables say where things are (bench/CONTRIBUTING_GPU.md):
#   DATA_DIR     the folder holding the token shards fineweb_val_*.bin and fineweb_train_*.bin
#                (default data/proxy), e.g. made by `python data/tokenize_corpus.py ... --out DIR`
#   RESULTS_DIR  where the finished run logs are copied (default bench/results/new; created)
# Relative paths are taken from the folder the script is started in; the script then runs from the
# repository root, where train_gpt.py writes logs/ and checkpoints/, with torchrun on the PATH and
# the train_gpt.py flags for DATA_DIR in the array PROXY.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced
  case "${1:-}" in -h|--help) sed -n '1,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
fi
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA_DIR="${DATA_DIR:-$REPO_ROOT/data/proxy}"
RESULTS_DIR="${RESULTS_DIR:-$REPO_ROOT/bench/results/new}"
if ! compgen -G "$DATA_DIR/fineweb_train_*.bin" >/dev/null || ! compgen -G "$DATA_DIR/fineweb_val_*.bin" >/dev/null; then
  echo "$(basename "$0"): error: DATA_DIR=$DATA_DIR lacks fineweb_train_*.bin or fineweb_val_*.bin" \
       "shards; tokenize a corpus with python data/tokenize_corpus.py INPUT... --out DIR and set DATA_DIR=DIR" >&2
  exit 1
fi
DATA_DIR="$(cd "$DATA_DIR" && pwd)"
mkdir -p "$RESULTS_DIR" && RESULTS_DIR="$(cd "$RESULTS_DIR" && pwd)" || exit 1
cd "$REPO_ROOT" || exit 1
echo "data: $DATA_DIR; results: $RESULTS_DIR"
export PYTHONUNBUFFERED=1
export PATH="$(dirname "$(python3 -c "import sys; print(sys.executable)")"):$PATH"  # torchrun beside python3
# PROXY: the shards in DATA_DIR and a validation set of 14 buffers of 65,536 tokens (even over 1 or 2 GPUs)
PROXY=(--train_files "$DATA_DIR/fineweb_train_*.bin" --val_files "$DATA_DIR/fineweb_val_*.bin" --val_tokens 917504 --val_seq_len 65536)
