#!/usr/bin/env bash
# A vLLM server that takes the trainer's weights, for `tierlm rl ... engine.kind=vllm engine.vllm_url=http://HOST:PORT`
# (and `tierlm eval`). Runs from vLLM's own environment (scripts/setup_vllm.sh).
#
#   bash scripts/vllm_server.sh MODEL_FOLDER [PORT] [more vLLM server options]
#
# VLLM_SERVER_DEV_MODE=1 opens the endpoints the trainer pushes weights through (/collective_rpc reload_weights,
# /update_weight_version, /weight_info): serve on a trusted network only (the default host is 127.0.0.1).
# The trainer writes each step's weights to RUN/sampler/model.safetensors and asks the server to reload that
# folder, so the server must see the run directory at the same path (one machine, or shared storage).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: bash scripts/vllm_server.sh MODEL_FOLDER [PORT] [vLLM options]" >&2
  exit 2
fi
MODEL="$1"
PORT="${2:-8000}"
shift $(($# < 2 ? $# : 2))
if [ ! -x .venv-vllm/bin/python ]; then
  echo "vllm_server: no .venv-vllm here: run bash scripts/setup_vllm.sh first" >&2
  exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1; then DTYPE="${VLLM_DTYPE:-bfloat16}"; else DTYPE="${VLLM_DTYPE:-float32}"; fi
# vLLM's CPU backend places its own threads: an inherited OMP_NUM_THREADS / MKL_NUM_THREADS (a trainer's
# environment often sets them) made the tiny task's rollouts 40x slower here (12 s a step against 0.3 s).
unset OMP_NUM_THREADS MKL_NUM_THREADS
export VLLM_SERVER_DEV_MODE=1
# A LoRA policy's adapters alone each step (its base loaded once) where the server takes LoRA adapters:
#   bash scripts/vllm_server.sh MODEL_FOLDER PORT --enable-lora --max-lora-rank 16   (a rank >= model.lora.r)
case " $* " in *" --enable-lora "*) export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True ;; esac
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"  # GiB of KV cache on a CPU
exec .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host "${VLLM_HOST:-127.0.0.1}" \
  --port "$PORT" --dtype "$DTYPE" --logprobs-mode processed_logprobs --enforce-eager --no-enable-chunked-prefill "$@"
