#!/usr/bin/env bash
# Set up .venv (if needed) and run the whole test suite: unit tests, doctests and CPU end-to-end runs.
#
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q "$@"
