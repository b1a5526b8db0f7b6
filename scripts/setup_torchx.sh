#!/usr/bin/env bash
# A virtual environment of its own for TorchX (.venv-torchx): torchx 0.7 pins urllib3<1.27, which tierlm's own
# environment does not take. TorchX only submits: the job it starts runs torchrun and tierlm from the image (a
# container) or, on its local_cwd scheduler, from the PATH it is given.
#
#   bash scripts/setup_torchx.sh
#   tierlm launch --torchx pretrain --config my.yaml --nodes 2 --out tierlm_torchx.py
#   PATH="$PWD/.venv/bin:$PATH" .venv-torchx/bin/torchx run -s local_cwd tierlm_torchx.py:train
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv-torchx/bin/python ] || "$PYTHON" -m venv .venv-torchx
.venv-torchx/bin/python -m pip install --quiet "torchx==0.7.0" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
echo "[setup_torchx] ready: $(.venv-torchx/bin/torchx --version 2>&1 | tail -1)" >&2
