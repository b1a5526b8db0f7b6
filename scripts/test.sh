#!/usr/bin/env bash
# Set up .venv (if needed), check lint and formatting (ruff), build the documentation site strictly (a broken link
# or reference fails), then run the whole test suite: unit tests, doctests, the import contracts of the tiers and
# CPU end-to-end runs — on two pytest-xdist workers (a file's tests on one worker, one thread each; the longest files
# first, tests/conftest.py), then the tests
# marked `serial` alone (timed around signals, kills and hangs, or DeepSpeed's shutdown); the slowest are listed, and
# the coverage of tierlm in the test processes is printed with the modules under half covered
# (scripts/coverage_summary.py).
#
#   bash scripts/test.sh [pytest args]     # with arguments: just those, in one process
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
SITE=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$SITE"
rm -rf "$SITE"
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q --durations=25 "$@"
fi
rm -rf .coverage-data
status=0  # both parts run and the coverage is printed whatever the first part's outcome; any failure fails the script
.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" --durations=20 --cov --cov-report= || status=$?
# The serial tests are collected from the files that mark them (not all 1,300 tests and every module's doctests: 25 s)
mapfile -t SERIAL < <(grep -l "pytest.mark.serial" tests/test_*.py)
.venv/bin/python -m pytest -q -m serial --durations=10 --cov --cov-append --cov-report= "${SERIAL[@]}" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
.venv/bin/python scripts/coverage_summary.py
exit $status
