#!/usr/bin/env bash
# Set up .venv (if needed), check lint and formatting (ruff), build the documentation site strictly (a broken link
# or reference fails), then run the whole test suite: unit tests, doctests, the import contracts of the tiers and
# CPU end-to-end runs; the 25 slowest tests are listed last.
#
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
SITE=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$SITE"
rm -rf "$SITE"
exec .venv/bin/python -m pytest -q --durations=25 "$@"
