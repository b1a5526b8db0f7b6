"""The suite's coverage of tierlm, printed by scripts/test.sh after the tests: the total and the modules under
half covered, named (what the test processes ran; code run only in the processes they start is not counted)."""

from __future__ import annotations

import sys

import coverage

UNDER = 50.0


def main() -> int:
    data = coverage.Coverage()
    data.load()
    rows = []
    total_statements = total_missing = 0
    for path in sorted(data.get_data().measured_files()):
        _, statements, _, missing, _ = data.analysis2(path)
        total_statements, total_missing = total_statements + len(statements), total_missing + len(missing)
        if statements:
            rows.append((100.0 * (len(statements) - len(missing)) / len(statements), path, len(statements)))
    if not total_statements:
        print("coverage: nothing measured", file=sys.stderr)
        return 1
    share = 100.0 * (total_statements - total_missing) / total_statements
    print(f"coverage of tierlm in the test processes: {share:.1f}% of {total_statements:,} statements")
    low = sorted(row for row in rows if row[0] < UNDER)
    if low:
        print(f"modules under {UNDER:.0f}% (run only in subprocesses, or untested):")
        for percent, path, statements in low:
            print(f"  {percent:5.1f}%  {path.split('/src/', 1)[-1]}  ({statements} statements)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
