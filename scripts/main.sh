#!/usr/bin/env bash
# The main job, from a fresh machine: set up .venv, then a tiny pretrain -> SFT run on the embedded
# synthetic arithmetic task (data generated here, a BPE tokenizer trained on it, CPU, a few minutes),
# ending with the run directory, the final val loss and a sample answer.
#
#   bash scripts/main.sh
#
# Re-running continues the runs in runs/ (finished runs just report); delete runs/ to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
TIERLM=.venv/bin/tierlm
PROMPT="What is 23 + 45?"

echo "== pretrain (configs/tiny_pretrain.yaml)" >&2
$TIERLM pretrain --config configs/tiny_pretrain.yaml
echo "== sft (configs/tiny_sft.yaml)" >&2
$TIERLM sft --config configs/tiny_sft.yaml | tee runs/tiny_sft.summary
echo "== rl (configs/tiny_rl.yaml)" >&2
$TIERLM rl --config configs/tiny_rl.yaml | tee runs/tiny_rl.summary
echo "== sample" >&2
ANSWER=$($TIERLM sample --checkpoint runs/tiny_rl --prompt "$PROMPT")

echo
echo "run directories: runs/tiny_pretrain, runs/tiny_sft, runs/tiny_rl (each with report.md and plots/)"
grep "final val loss" runs/tiny_sft.summary | sed 's/^/sft /'
grep "held-out pass@1" runs/tiny_rl.summary | sed 's/^/rl /'
echo "sample: $PROMPT -> $ANSWER"
