#!/usr/bin/env bash
# The record line's techniques at 60% of the development protocol's tokens (issue 12): the public
# 09/03 code's 200-step schedule (26.2M tokens) ends at val 2.980 (bench/results/fidelity_0903_h100.md);
# each variant here trains ~15.7M tokens (60%) with its own batch size and step count, so the
# final val losses compare at equal tokens. "core" = the techniques the record preset adopted; "all" =
# core + bigram table (with the record's decay) + multi-token prediction. Also the three techniques
# not yet run at the 200-step schedule. Runs share the GPU (val losses only; step times mean nothing).
#
#   bash bench/token_budget_ab.sh PUBLIC_CHECKOUT SHARD_DIR OUT_DIR [--seeds 0 1] [more harness flags]
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
public=$1 shards=$2 out=$3
shift 3
cd "$(dirname "$0")/.."
core="--logit_softcap 23 --softcap_shift 5 --backout_layer 8 --orthogonalizer polar_express --cooldown_frac 0.6 --final_lr_frac 0.15 --doc_len_schedule 896,2048,2048"
all="$core --bigram_rows 377280 --bigram_sign_rows 8192 --embed_weight_decay 0.0125 --embed_adam_betas 0.75,0.95 --mtp_weights 0.5,0.25,0.5,0,0,0"
b44="--batch_schedule 44032,44032,44032 --num_iterations 357"      # 357 x 44,032 = 15.72M tokens
b32="--batch_schedule 32768,32768,32768 --num_iterations 480"      # 480 x 32,768
b65="--batch_schedule 65536,65536,65536 --num_iterations 240"      # 240 x 65,536
staged="--batch_schedule 44032,87040,131072 --lr_schedule 1,1.52,1.73"  # the record's 1/3, 2/3, 1 batches and LRs
python3 bench/fidelity_0903.py --public "$public" --train_files "$shards/fineweb_train_*.bin" \
    --val_files "$shards/fineweb_val_*.bin" --batch_size 131072 --val_tokens 983040 --val_seq_len 40960 \
    --val_every 50 --steps 200 --seeds 0 --public_seeds --parallel --work /tmp/token_budget_ab \
    --label base --target 2.980 \
    --variant mtp "--mtp_weights 0.5,0.25,0.5,0,0,0" \
    --variant polar_express "--orthogonalizer polar_express" \
    --variant bigram_decay "--bigram_rows 377280 --bigram_sign_rows 8192 --embed_weight_decay 0.0125 --embed_adam_betas 0.75,0.95" \
    --variant all_fixed120 "$all --num_iterations 120" \
    --variant all_staged180 "$all $staged --num_iterations 180" \
    --variant all_staged150 "$all $staged --num_iterations 150" \
    --variant core_staged180 "$core $staged --num_iterations 180" \
    --variant core_staged22 "$core --batch_schedule 22016,44032,87040 --lr_schedule 0.71,1,1.41 --num_iterations 306" \
    --variant all_b65 "$all $b65 --lr_schedule 1.22,1.22,1.22" \
    --variant core_b65 "$core $b65 --lr_schedule 1.22,1.22,1.22" \
    --variant core_b65_lr1 "$core $b65" \
    --variant base_b44 "$b44" \
    --variant core_b44 "$core $b44" \
    --variant core_b44_lr07 "$core $b44 --lr_schedule 0.7,0.7,0.7" \
    --variant all_b44 "$all $b44" \
    --variant core_b32 "$core $b32" \
    --variant all_b32 "$all $b32" \
    "$@" --out "$out/token_budget_ab.md"
