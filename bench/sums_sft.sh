#!/usr/bin/env bash
# A tiny model for the heavy-tailed task synthetic:sums (sums of 2-16 numbers, one calculator call per addition):
# pretrain -> SFT into runs/sums/, the start for `bench/rl.py --task synthetic:sums --sft runs/sums/sft`, where a
# plain step waits for its longest answer and partial rollouts let it go on across steps. CPU, a few minutes.
#
#   bash bench/sums_sft.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TIERLM=.venv/bin/tierlm
COMMON=(data.dataset_name=synthetic:sums data.max_seq_length=384 infra.progress_bar=false)
$TIERLM pretrain --config configs/tiny_pretrain.yaml "${COMMON[@]}" training.per_device_train_batch_size=8 \
    training.num_train_steps=600 training.save_steps=600 infra.output_dir=runs/sums/pre | tail -2
$TIERLM sft --config configs/tiny_sft.yaml "${COMMON[@]}" model.model_name_or_path=runs/sums/pre \
    infra.output_dir=runs/sums/sft | tail -2
