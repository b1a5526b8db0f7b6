"""The sandbox against hostile programs: each is contained, scored as a failure, the test process (the "run")
unharmed, and nothing it started is left running."""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from tierlm.tasks.code import code_reward, extract_code, run_with_tests
from tierlm.tasks.sandbox import Limits, Sandbox, isolation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox confines Linux processes")

LIMITS = Limits(cpu_seconds=1, wall_seconds=3, memory_mb=512, processes=16, file_bytes=1 << 20, disk_bytes=8 << 20)
WORKERS = 2


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(LIMITS, workers=WORKERS)
    yield box
    box.close()


def _sandbox_processes(uids) -> list[int]:
    """Processes still running (not zombies waiting for init) as one of UIDS (a pool's slots' users)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                running = "\nState:\tZ" not in (entry / "status").read_text()
                if entry.stat().st_uid in uids and running:
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return found


def test_this_machine_grants_the_isolation_the_suite_checks():
    """CI's machines grant them all (it runs as root); the docs name which mechanism covers what."""
    granted = isolation()
    assert granted["landlock"] >= 4 and granted["network_namespace"] and granted["unix_sockets"], granted
    assert granted["disk_limit"] == granted["separate_user"], granted


def test_a_plain_program_runs_and_its_output_comes_back(sandbox):
    result = sandbox.run("import sys\nprint(6 * 7)\nprint('note', file=sys.stderr)\n")
    assert result.ok and result.stdout == "42\n" and result.stderr == "note\n", result


def test_hostile_programs_are_contained_and_scored_as_failures(sandbox, tmp_path, monkeypatch):
    secret_file = tmp_path / "run" / "config.yaml"
    secret_file.parent.mkdir()
    secret_file.write_text("api_key: hunter2\n")
    secret_file.chmod(0o644)
    monkeypatch.setenv("TIERLM_TEST_SECRET", "hunter2")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    outside = Path("/tmp") / f"tierlm-sandbox-escape-{os.getpid()}"
    # A pathname Unix socket anyone may connect to (as the system D-Bus is on most machines), and an abstract one
    unix_path, unix_heard = str(tmp_path / "bus"), []
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    os.chmod(unix_path, 0o777)
    os.chmod(tmp_path, 0o755)
    unix.listen()
    threading.Thread(target=lambda: unix_heard.append(unix.accept()), daemon=True).start()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0tierlm-sandbox-{os.getpid()}")
    abstract.listen()
    threading.Thread(target=lambda: unix_heard.append(abstract.accept()), daemon=True).start()
    programs = {
        "infinite loop": "while True:\n    pass\n",
        "sleeps forever": "import time\ntime.sleep(10_000)\n",
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "10 GB allocation": "x = bytearray(10 * 2**30)\nprint(len(x))\n",
        "writes outside its folder": f"open({str(outside)!r}, 'w').write('x')\n",
        "reads the run's files": f"print(open({str(secret_file)!r}).read())\n",
        "reads the trainer's environment": (
            "import os\nprint(os.environ.get('TIERLM_TEST_SECRET'))\n"
            f"print(open('/proc/{os.getpid()}/environ').read())\n"
        ),
        "opens a socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
        "connects to a host's Unix socket": (
            f"import socket\nsocket.socket(socket.AF_UNIX).connect({unix_path!r})\nprint('connected')\n"
        ),
        "connects to an abstract Unix socket": (
            f"import socket\nsocket.socket(socket.AF_UNIX).connect('\\0tierlm-sandbox-{os.getpid()}')\n"
        ),
        "fills the disk with small files": (
            "chunk = b'x' * 2**19\nfor i in range(10_000):\n    open(f'f{i}', 'wb').write(chunk)\n"
        ),
        "prints 1 GB": "import sys\nchunk = 'x' * 2**20\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n",
        "kills its parent": f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n",
        "daemonises and lingers": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(10_000)\n"
            "    os._exit(0)\nraise SystemExit(1)\n"
        ),
    }
    results = dict(zip(programs, sandbox.run_many(list(programs.values()))))
    for name, result in results.items():
        assert not result.ok, f"{name}: {result}"
        assert "hunter2" not in result.stdout, name
    assert results["10 GB allocation"].status == "error" and "MemoryError" in results["10 GB allocation"].stderr
    flood = results["prints 1 GB"]  # Python ignores SIGXFSZ: the write past the limit fails with EFBIG instead
    assert "File too large" in flood.stderr and len(flood.stdout) <= LIMITS.file_bytes, flood.stderr[-300:]
    assert results["infinite loop"].status in ("killed", "timeout") and results["sleeps forever"].status == "timeout"
    assert all(r.wall_s < LIMITS.wall_seconds + 5 for r in results.values())
    assert not outside.exists() and not accepted and not unix_heard
    unix_refused = results["connects to a host's Unix socket"].stderr
    assert "PermissionError" in unix_refused and "connected" not in results["connects to a host's Unix socket"].stdout
    if isolation()["disk_limit"]:  # each file under the per-file limit, all of them past the disk limit
        assert "No space left on device" in results["fills the disk with small files"].stderr
    listener.close(), unix.close(), abstract.close()
    if isolation()["separate_user"]:
        left = _sandbox_processes({uid for uid, _ in sandbox._uids})
        assert left == []  # the fork bomb's and the daemon's processes are gone
    os.kill(os.getpid(), 0)  # still here


@pytest.mark.skipif(not isolation()["separate_user"], reason="pools take user ids of their own as root only")
def test_two_pools_never_share_a_user_id(tmp_path):
    """Two pools (here in one process; two ranks' or two test workers' pools are two processes, whose locks the
    kernel keeps apart the same way) take disjoint ids, so neither's clean-up kills the other's programs: one pool's
    program still runs, and ends well, while the other kills everything left under its ids. Closing a pool gives its
    ids back: a later pool may take them (unless another test's pool took them first)."""
    import dataclasses

    roomy = dataclasses.replace(LIMITS, wall_seconds=10)  # the 1.5 s sleeper is not timed out on a busy machine
    first = Sandbox(roomy, workers=2)
    second = Sandbox(roomy, workers=2)
    try:
        mine, theirs = ({uid for uid, _ in box._uids} for box in (first, second))
        assert len(mine) == len(theirs) == 2 and not mine & theirs
        slow = first._pool.submit(first.run, "import time\ntime.sleep(1.5)\nprint('done')\n")
        time.sleep(0.5)
        second.run_many(["import os\nos.fork()\nraise SystemExit(1)\n"] * 2)  # each ends with _kill_user
        assert slow.result().ok and "done" in slow.result().stdout
    finally:
        first.close()
    assert all(lock.closed for _, lock in first._uids)  # closing the files drops their locks (flock)
    third = Sandbox(roomy, workers=2)
    assert not {uid for uid, _ in third._uids} & theirs  # still held by the open pool
    third.close(), second.close()
    dropped = Sandbox(roomy, workers=2)  # never closed, as a reward's or a tool's pool when its run ends
    locks = [lock for _, lock in dropped._uids]
    del dropped
    gc.collect()
    assert locks and all(lock.closed for lock in locks)


@pytest.mark.skipif(not isolation()["separate_user"], reason="pools take user ids of their own as root only")
@pytest.mark.parametrize("killer", ["kill", "interpreter"])
def test_a_daemon_that_left_the_programs_group_is_killed_with_its_user(killer, monkeypatch):
    """A program whose grandchild calls setsid leaves the process group the sandbox kills; the pool then kills what
    its slot's user still runs (`_kill_user`, a process of that user calling kill(-1): the system's `kill`, or where
    there is none an interpreter), here in a process that imported JAX, whose fork handlers warn when the trainer
    itself forks: nothing warns."""
    import dataclasses
    import shutil
    import warnings

    import tierlm.tasks.sandbox as sandbox_module

    if killer == "interpreter":
        which = shutil.which
        monkeypatch.setattr(
            sandbox_module.shutil, "which", lambda name, **kw: None if name == "kill" else which(name, **kw)
        )

    jax = pytest.importorskip("jax")
    jax.numpy.ones(1).block_until_ready()  # JAX's backend up: its fork handler warns from here on
    daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(600)\n"
    box = Sandbox(dataclasses.replace(LIMITS, wall_seconds=10), workers=1)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result = box.run(daemon + "    os._exit(0)\nos.wait()\nprint('parent done')\n")
        assert result.ok and "parent done" in result.stdout, result
        assert _sandbox_processes({uid for uid, _ in box._uids}) == []
        assert not [w for w in seen if "fork" in str(w.message)], [str(w.message) for w in seen]
    finally:
        box.close()


def test_code_reward_passes_only_a_program_that_reaches_the_end_of_its_tests(sandbox):
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    right = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert code_reward(sandbox, right, tests) == 1.0
    assert code_reward(sandbox, "```python\ndef add(a, b):\n    return a - b\n```", tests) == 0.0
    for escape in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "def add(a, b):\n    print('ok')\n"):
        passed, execution = run_with_tests(sandbox, escape, tests)
        assert not passed, (escape, execution)
    assert extract_code("no fences") == "no fences"


def test_a_requirement_the_machine_cannot_meet_is_refused():
    with pytest.raises(RuntimeError, match="needs warp_drive"):
        Sandbox(LIMITS, workers=1, require=("warp_drive",))


def test_a_signal_to_the_trainer_from_a_program_never_arrives(sandbox):
    """Separately from the batch above: the test installs a handler, so an arriving SIGUSR1 would be seen."""
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *a: seen.append(1))
    try:
        result = sandbox.run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGUSR1)\n")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert result.status == "error" and "PermissionError" in result.stderr and not seen
