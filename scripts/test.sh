#!/usr/bin/env bash
# Set up .venv (if needed), check lint and formatting (ruff), then run the whole test suite: unit tests,
# doctests, the import contracts of the tiers and CPU end-to-end runs; the 25 slowest tests are listed last.
#
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
exec .venv/bin/python -m pytest -q --durations=25 "$@"
