#!/usr/bin/env bash
# Launch a tierlm training run with Accelerate, on one machine or many, the way Accelerate-style FSDP2 training scripts do.
#
#   bash scripts/launch_training.sh [section.key=value ...]
#
# The environment chooses (each has a default): ACCELERATE_CONFIG (configs/accelerate_fsdp2.yaml, or
# configs/accelerate_deepspeed.yaml), TRAIN_CONFIG (a tierlm config or preset: ul2-tiny), STAGE (pretrain),
# OUTPUT_DIR (./output/<stage>-<date>), NUM_PROCESSES and MIXED_PRECISION (the Accelerate config's unless set;
# on CPU: NUM_PROCESSES=2 MIXED_PRECISION=no), and for several machines NUM_MACHINES, MACHINE_RANK,
# MAIN_PROCESS_IP and MAIN_PROCESS_PORT (run the script on every machine, MACHINE_RANK 0 on the first, with
# OUTPUT_DIR on a filesystem they share). Extra arguments are tierlm overrides.
set -euo pipefail
cd "$(dirname "$0")/.."

export WANDB_PROJECT="${WANDB_PROJECT:-tierlm}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # one BLAS thread per rank unless told otherwise
ACCELERATE_CONFIG="${ACCELERATE_CONFIG:-configs/accelerate_fsdp2.yaml}"
TRAIN_CONFIG="${TRAIN_CONFIG:-ul2-tiny}"
STAGE="${STAGE:-pretrain}"
OUTPUT_DIR="${OUTPUT_DIR:-./output/${STAGE}-$(date +%Y%m%d_%H%M%S)}"
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"

launch=(--config_file "$ACCELERATE_CONFIG")
[ -n "${NUM_PROCESSES:-}" ] && launch+=(--num_processes "$NUM_PROCESSES")
[ -n "${MIXED_PRECISION:-}" ] && launch+=(--mixed_precision "$MIXED_PRECISION")
if [ -n "${NUM_MACHINES:-}" ]; then
  launch+=(--num_machines "$NUM_MACHINES" --machine_rank "${MACHINE_RANK:?set MACHINE_RANK on every machine}"
           --main_process_ip "${MAIN_PROCESS_IP:?set MAIN_PROCESS_IP (the first machine)}"
           --main_process_port "${MAIN_PROCESS_PORT:-29500}")
fi

exec "$PYTHON" -m accelerate.commands.launch "${launch[@]}" \
    -m tierlm "$STAGE" --config "$TRAIN_CONFIG" "infra.output_dir=$OUTPUT_DIR" "$@"
