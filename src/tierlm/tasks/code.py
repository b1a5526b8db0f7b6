"""Code with tests: a completion's program, run with its tests in the sandbox (`tierlm.tasks.sandbox`), earns 1.0
when every test passes.

The tests run after the program in one script; the script proves it reached its end by printing a random
token that it read (and deleted) before the program ran, so a program that exits early with status 0
(`sys.exit(0)`, `os._exit(0)`) passes nothing.
"""

from __future__ import annotations

import re
import secrets

from tierlm.tasks.sandbox import Execution, Sandbox

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

_HARNESS = """import os as _os
with open(".token") as _f:
    _token = _f.read()
_os.remove(".token")
_namespace = {"__name__": "__main__"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), _namespace)
exec(compile(open("tests.py").read(), "tests.py", "exec"), _namespace)
print(_token)
"""


def extract_code(completion: str) -> str:
    """The last fenced code block of a completion (the whole text when it has none).

    >>> extract_code("Here:\\n```python\\ndef f():\\n    return 1\\n```\\nDone.")
    'def f():\\n    return 1\\n'
    >>> extract_code("def g(): pass")
    'def g(): pass'
    """
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def run_with_tests(sandbox: Sandbox, code: str, tests: str) -> tuple[bool, Execution]:
    """(did every test pass, what the script did) for `code` followed by `tests` (asserts, or a `check(...)` call)."""
    token = secrets.token_hex(16)
    files = {"solution.py": code, "tests.py": tests, ".token": token}
    execution = sandbox.run(_HARNESS, files)
    lines = execution.stdout.rstrip("\n").splitlines()
    return execution.ok and bool(lines) and lines[-1] == token, execution


def run_many_with_tests(sandbox: Sandbox, programs: list[tuple[str, str]]) -> list[bool]:
    """Whether each (code, tests) passes, run in the sandbox's pool."""
    return [passed for passed, _ in sandbox.map(lambda program: run_with_tests(sandbox, *program), programs)]


def code_reward(sandbox: Sandbox, completion: str, tests: str) -> float:
    """1.0 when the completion's code passes `tests` in the sandbox, else 0.0 (a crash, a timeout, a hostile
    program: each is one failed sample)."""
    passed, _ = run_with_tests(sandbox, extract_code(completion), tests)
    return 1.0 if passed else 0.0
