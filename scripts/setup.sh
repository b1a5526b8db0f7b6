#!/usr/bin/env bash
# Set up a virtual environment in .venv with tierlm installed (editable) and its extras.
#
#   bash scripts/setup.sh [EXTRAS]      # EXTRAS defaults to "dev"
#
# torch is handled first and on its own: an existing torch (in this Python's site-packages,
# which the venv can see) is kept as it is; otherwise torch==2.13.0 is installed. Every later
# install is pinned to that torch by a constraints file, so pip never swaps it for a newer
# build (on a CPU machine that would pull several GB of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-dev}"
PYTHON="${PYTHON:-python3}"
TORCH_DEFAULT="2.13.0"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
# This machine's pip config lists index folders that may not exist; pip warns once per package.
quiet_pip() { "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] no torch found: installing torch==$TORCH_DEFAULT" >&2
  quiet_pip install --quiet "torch==$TORCH_DEFAULT"
fi
TORCH_VERSION=$("$VPY" -c "import torch; print(torch.__version__.split('+')[0])")
echo "torch==$TORCH_VERSION" > .venv/torch-constraint.txt

# Skip the (slow, networked) install when the package and its extras are already in place.
STAMP=.venv/.tierlm-installed-$EXTRAS
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  PIP_CONSTRAINT=.venv/torch-constraint.txt quiet_pip install --quiet -e ".[$EXTRAS]"
  touch "$STAMP"
fi
# The dev install's browser test drives the system's Chromium (Playwright, tests/test_serve.py): install it
# from the OS packages when it is missing and this user can; otherwise that one test skips, saying so.
if [ "$EXTRAS" = dev ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing chromium from the OS packages (for the browser test)" >&2
  { apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; } \
    || echo "[setup] could not install chromium; the browser test will skip" >&2
fi
echo "[setup] ready: $("$VPY" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')" >&2
