"""Write tests/durations.json — each test file's seconds (setup + call + teardown of its tests) — from the junit XML
of a whole run, for the order in which scripts/test.sh deals files to its workers (tests/conftest.py):

    .venv/bin/python -m pytest -n 2 --dist loadfile -m "not serial" --junitxml=/tmp/junit.xml
    .venv/bin/python scripts/test_durations.py /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(junit: str) -> None:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        path = "/".join(module[: next((i + 1 for i, m in enumerate(module) if m.startswith("test_")), len(module))])
        seconds[path + ".py"] += float(case.get("time", 0.0))
    table = {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}
    (REPO / "tests" / "durations.json").write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(table)} files, {sum(table.values()):.0f} s in all; longest: {next(iter(table.items()))}")


if __name__ == "__main__":
    main(sys.argv[1])
