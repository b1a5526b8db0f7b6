#!/usr/bin/env bash
# The main job (scripts/main.sh: pretrain -> SFT -> RL on the synthetic arithmetic task) at one seed, thread count
# and CPU kernel level, in runs/band/<name>/, ending with one line of its figures. The README's band and the table in
# docs/benchmarks.md ("The main job across seeds, threads and CPU kernels") come from runs of this script, one at a
# time (two at once slow each other down, though the figures stay the same):
#
#   bash bench/main_job_band.sh SEED THREADS [KERNELS]
#
# SEED: "yaml" keeps the configs' own seeds (what scripts/main.sh runs), a number sets training.seed in all three
# stages. KERNELS: the ATen and oneDNN instruction level (avx512, avx2, default: scalar) — another CPU's floating
# point on this one; left out, this CPU's best.
set -euo pipefail
cd "$(dirname "$0")/.."
SEED=$1 THREADS=$2 KERNELS=${3:-}
NAME=s${SEED}_t${THREADS}${KERNELS:+_$KERNELS}
OUT=runs/band/$NAME
mkdir -p "$OUT"
export OMP_NUM_THREADS=$THREADS
if [ -n "$KERNELS" ]; then
    export ATEN_CPU_CAPABILITY=$KERNELS
    export DNNL_MAX_CPU_ISA=$(case $KERNELS in avx512) echo AVX512_CORE ;; avx2) echo AVX2 ;; *) echo SSE41 ;; esac)
fi
SEEDS=()
[ "$SEED" != yaml ] && SEEDS=("training.seed=$SEED")
TIERLM=.venv/bin/tierlm
START=$(date +%s)
$TIERLM pretrain --config configs/tiny_pretrain.yaml "${SEEDS[@]}" infra.output_dir="$OUT/pre" \
    infra.progress_bar=false > "$OUT/pre.log" 2>&1
$TIERLM sft --config configs/tiny_sft.yaml "${SEEDS[@]}" model.model_name_or_path="$OUT/pre" \
    infra.output_dir="$OUT/sft" infra.progress_bar=false > "$OUT/sft.log" 2>&1
$TIERLM rl --config configs/tiny_rl.yaml "${SEEDS[@]}" model.model_name_or_path="$OUT/sft" \
    infra.output_dir="$OUT/rl" infra.progress_bar=false > "$OUT/rl.log" 2>&1
echo "$NAME | pretrain $(grep 'final val loss' "$OUT/pre.log" | sed 's/final //') | sft $(grep 'final val loss' \
    "$OUT/sft.log" | sed 's/final //') | rl $(grep 'held-out pass@1' "$OUT/rl.log" | sed 's/held-out //') | \
$(( $(date +%s) - START )) s"
