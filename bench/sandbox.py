"""The code sandbox's cost and throughput against a bare `python -c` process per program.

    .venv/bin/python bench/sandbox.py [--programs 64]

Three ways to run the same `--programs` small programs (a function and three asserts, as a code-with-tests
reward runs them): a bare `subprocess.run([python, "-c", ...])` each, one after another (the floor: a process per
program, no confinement); tierlm's `Sandbox` with 1 worker (every limit, the network namespace, Landlock, the
per-slot user and the cleanup after each program); and the `Sandbox` pool with 2 and 4 workers. Printed:
programs/s and milliseconds per program, and each row's ratio to the bare floor. On this 2-core machine a pool
wider than the cores only overlaps process start-up.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from tierlm.tasks.code import run_many_with_tests
from tierlm.tasks.sandbox import Limits, Sandbox, isolation

CODE = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(10, 5) == 15\n"


def bare(n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        subprocess.run([sys.executable, "-I", "-c", CODE + TESTS], check=True)
    return time.perf_counter() - start


def pooled(n: int, workers: int) -> float:
    box = Sandbox(Limits(), workers=workers)
    try:
        start = time.perf_counter()
        passed = run_many_with_tests(box, [(CODE, TESTS)] * n)
        elapsed = time.perf_counter() - start
    finally:
        box.close()
    assert all(passed), "a program failed in the sandbox"
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=64)
    n = parser.parse_args().programs
    print(f"isolation: {isolation()}")
    floor = bare(n)
    rows = [("bare python -c, serial", floor)] + [(f"sandbox, {w} worker(s)", pooled(n, w)) for w in (1, 2, 4)]
    print(f"{'':28} {'programs/s':>10} {'ms/program':>10} {'vs bare':>8}")
    for name, seconds in rows:
        print(f"{name:28} {n / seconds:10.1f} {1000 * seconds / n:10.1f} {floor / seconds:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
