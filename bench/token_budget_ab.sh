#!/usr/bin/env bash
# The record line's techniques at 60% of the development protocol's tokens (issue 12): the public
# 09/03 code's 200-step schedule (26.2M tokens) ends at val 2.955-2.995 (bench/results/fidelity_0903_h100.md
# and token_budget2_h200_20261123/); each variant here trains ~15.7M tokens (60%), so the final val
# losses compare at equal tokens. Runs share the GPU (val losses only; step times mean nothing).
#   ROUND=1: batch sizes and step counts; "core" = the first five techniques the record preset
#            adopted, "all" = core + bigram table (with the record's decay) + multi-token prediction.
#   ROUND=2: 44,032 x 357 with core as the base, each of the five techniques built later added
#            alone and together, momentum warm-up over 100 steps, one micro-batch per step.
#   ROUND=3: 44,032 x 357 in one micro-batch per step, the record preset (core + key offset)
#            as the base: paired-head attention, Muon's cautious weight decay (0.43: the record's decay
#            per step at our Muon lr), value-embedding gates, the embedding tied to the head for two
#            stages, block 0 without MLP, and the first three together.
#   ROUND=4 (default): the record preset at 44,032 x 357 in one micro-batch, tuned for the short run:
#            final LR 0.05, cooldown over 75%, LR x 1.3, longer windows (5, 9, 13), 32,768 x 480,
#            multi-token prediction, five value-embedding tables.
#   ROUND=8: the record preset as it is now, at 480 x 32,768 in one micro-batch (the comparison's
#            settings), two seeds each, three runs at a time (23 GiB each; pass --max_parallel 5 on an
#            H200): learnable XSA, the LM head's Adam betas 0.5/0.95 with cautious decay 0.375, the
#            cross-entropy unfused (the preset fuses it), and 400 / 360 steps (50% / 45% of the public
#            run's tokens).
#   Rounds 3 and 4 ran on the record preset of their time; it has since taken round 6's Muon momentum
#   and round 7's bigram table and fused MLP (bench/results/token_budget6_h100.md, token_budget7_h100.md),
#   and the fused cross-entropy (which refuses multi-token prediction: round 4's mtp variant turns it off):
#   to rerun them as they ran, check out commit 1c8e29a.
#
#   [ROUND=1|2|3|4|8] bash bench/token_budget_ab.sh PUBLIC_CHECKOUT SHARD_DIR OUT_DIR [more harness flags]
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
public=$1 shards=$2 out=$3
shift 3
cd "$(dirname "$0")/.."
core="--logit_softcap 23 --softcap_shift 5 --backout_layer 8 --orthogonalizer polar_express --cooldown_frac 0.6 --final_lr_frac 0.15 --doc_len_schedule 896,2048,2048"
all="$core --bigram_rows 377280 --bigram_sign_rows 8192 --embed_weight_decay 0.0125 --embed_adam_betas 0.75,0.95 --mtp_weights 0.5,0.25,0.5,0,0,0"
b44="--batch_schedule 44032,44032,44032 --num_iterations 357"      # 357 x 44,032 = 15.72M tokens
one="--batch_size 44032 --seq_len 44032 --max_num_docs 256"  # b44 in one micro-batch per step (28 GiB a run)
yarn="--yarn true --attn_scale 0.1 --final_val_window 13"
b32="--batch_schedule 32768,32768,32768 --num_iterations 480"      # 480 x 32,768
b65="--batch_schedule 65536,65536,65536 --num_iterations 240"      # 240 x 65,536
staged="--batch_schedule 44032,87040,131072 --lr_schedule 1,1.52,1.73"  # the record's 1/3, 2/3, 1 batches and LRs
protocol=(--public "$public" --train_files "$shards/fineweb_train_*.bin" --val_files "$shards/fineweb_val_*.bin"
          --batch_size 131072 --val_tokens 983040 --val_seq_len 40960 --val_every 50 --steps 200 --target 2.980)
round=${ROUND:-4}
# rounds 3 and 4: two seeds of the record preset at 44,032 x 357 in one micro-batch, four runs at a time
on_record=(python3 bench/side_by_side.py --public_code 0903 "${protocol[@]}" --seeds 0 1 --public_seeds --parallel --max_parallel 4
           --label record --ours_args "--preset record $b44 $one")
if [ "$round" = 1 ]; then
  python3 bench/side_by_side.py --public_code 0903 "${protocol[@]}" --seeds 0 --public_seeds --parallel --work /tmp/token_budget_ab \
      --label base \
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
elif [ "$round" = 2 ]; then
  five="--muon_beta2 0.9 $yarn --smear true --ve_gate true --key_offset true"
  python3 bench/side_by_side.py --public_code 0903 "${protocol[@]}" --seeds 0 1 --public_seeds --parallel --max_parallel 9 \
      --work /tmp/token_budget_ab2 --label core --ours_args "$core $b44" \
      --variant normuon "--muon_beta2 0.9" \
      --variant yarn "$yarn" \
      --variant smear "--smear true" \
      --variant ve_gate "--ve_gate true" \
      --variant key_offset "--key_offset true" \
      --variant all5 "$five" \
      --variant best "--key_offset true $yarn --ve_gate true" \
      --variant mom100 "--muon_momentum_warmup 100" \
      --variant core_1mb "$one" \
      "$@" --out "$out/token_budget_ab2.md"
elif [ "$round" = 3 ]; then
  # round 3 also ran --variant no_mlp0 "--no_mlp_layers 0", a field deleted since (bench/README gives its result)
  "${on_record[@]}" --work /tmp/token_budget_ab3 \
      --variant paired "--paired_head_blocks 1,3,6,10" \
      --variant muon_wd043 "--muon_weight_decay 0.43" \
      --variant ve_gate "--ve_gate true" \
      --variant tied2 "--tied_embed_stages 2" \
      --variant combo "--paired_head_blocks 1,3,6,10 --muon_weight_decay 0.43 --ve_gate true" \
      "$@" --out "$out/token_budget_ab3.md"
elif [ "$round" = 8 ]; then
  python3 bench/side_by_side.py --public_code 0903 "${protocol[@]}" --seeds 0 1 --public_seeds --parallel --max_parallel 3 \
      --work /tmp/token_budget_ab8 --label record \
      --ours_args "--preset record $b32 --batch_size 32768 --seq_len 32768 --max_num_docs 256" \
      --variant xsa "--xsa true" \
      --variant head "--head_adam_betas 0.5,0.95 --head_weight_decay 0.375" \
      --variant unfused_ce "--fused_ce false" \
      --variant n400 "--num_iterations 400" \
      --variant n360 "--num_iterations 360" \
      "$@" --out "$out/token_budget_ab8.md"
else
  "${on_record[@]}" --work /tmp/token_budget_ab4 \
      --variant final_lr005 "--final_lr_frac 0.05" \
      --variant cooldown075 "--cooldown_frac 0.75" \
      --variant lr13 "--lr_schedule 1.3,1.3,1.3" \
      --variant ws5_9_13 "--window_schedule 5,9,13" \
      --variant b32 "--batch_schedule 32768,32768,32768 --num_iterations 480 --batch_size 32768 --seq_len 32768" \
      --variant mtp "--mtp_weights 0.5,0.25,0.5,0,0,0 --fused_ce false" \
      --variant ve5 "--num_value_embeds 5" \
      "$@" --out "$out/token_budget_ab4.md"
fi
