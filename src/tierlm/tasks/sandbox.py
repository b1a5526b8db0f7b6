"""A sandbox for model-written code: each program runs in its own process, so a hostile or broken one costs one
sample's reward, never the run or the machine.

Every execution gets
- an empty temporary working folder (deleted afterwards), a minimal environment (no secrets) and no stdin;
- limits: CPU seconds, wall seconds, address space, processes, open files and file size (stdout and stderr are
  files too, so a flood of output stops at `Limits.file_bytes`);
- no network: a network namespace of its own (no interface but a down loopback);
- Landlock (Linux >= 5.13): reads only of the system's and the interpreter's folders, writes only in its working
  folder, no TCP connect / bind (ABI >= 4), no signals to processes outside the sandbox (ABI >= 6);
- no Unix sockets: a seccomp filter fails socket(AF_UNIX) with EACCES, so no socket of the host is reachable —
  not the system D-Bus, not a container runtime's (Landlock scopes abstract sockets only; a pathname socket is
  reached through the file system, which the network namespace does not cover);
- as root: a user id of its own per pool slot, held by no other pool on the machine (another process's pool, a
  second rank's), so the process limit applies and, afterwards, every process left under that id (a daemonised
  grandchild too) is killed; and its working folder a tmpfs of `Limits.disk_bytes` in a
  mount namespace of its own, so many files under the per-file limit cannot fill the disk together.

`isolation()` says which of these this machine grants; `Sandbox(require=...)` refuses to run without the ones it
names. The program's interpreter is `sys.executable` unless the sandbox user cannot reach it (a root-owned
pyenv under /root), then the system's python3.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

SANDBOX_UID = 61000
"""As root, pools run programs as user ids from SANDBOX_UID up (no account needed), one per slot, each claimed."""
UID_LOCKS = Path(tempfile.gettempdir()) / "tierlm-sandbox-uids"


def _claim_uids(count: int) -> list:
    """COUNT user ids from SANDBOX_UID up that no other pool on this machine holds, each held by an exclusive lock
    on its file in UID_LOCKS (the open files returned: the kernel drops the locks when they are closed or the
    process ends, SIGKILL included). Two pools sharing an id would kill each other's programs (`_kill_user`) and
    share its process limit — two ranks of one torchrun job, or two test workers, each with its pool."""
    import fcntl

    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    held = []
    for uid in range(SANDBOX_UID, SANDBOX_UID + 4096):
        lock = open(UID_LOCKS / f"{uid}.lock", "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        held.append((uid, lock))
        if len(held) == count:
            return held
    for _, lock in held:
        lock.close()
    raise RuntimeError(f"no {count} free sandbox user ids from {SANDBOX_UID} (every one held by another pool)")


def _release(pool: ThreadPoolExecutor, uids: list) -> None:
    """A pool's end (`Sandbox.close`, or its garbage collection): its threads stop, its user ids go back to the
    machine (closing a lock file drops its lock)."""
    pool.shutdown(wait=True)
    for _, lock in uids:
        lock.close()


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_mb: int = 1024
    """Address space (RLIMIT_AS): an allocation past it raises MemoryError."""
    processes: int = 16
    """Processes and threads a program may start (as root, each pool slot's own user id; otherwise on top of what
    the trainer's user already runs, a bound that slots share)."""
    file_bytes: int = 1 << 20
    """The largest file it may write, stdout and stderr included (past it the program is killed)."""
    open_files: int = 64
    disk_bytes: int = 64 << 20
    """What all its files together may hold (its working folder is a tmpfs of this size: as root, see
    `isolation()["disk_limit"]`); past it a write fails with ENOSPC."""


@dataclass
class Execution:
    """What one program did. `status`: ok (exit 0), error (another exit code), timeout (wall time), killed (a
    signal: CPU time, file size, ...), or refused (the sandbox could not start it)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# -- the child's side: a launcher run by the trusted interpreter, which confines itself, then execs ----------------
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
lim = spec["limits"]
for name, value in (("RLIMIT_CPU", (lim["cpu_seconds"], lim["cpu_seconds"] + 1)),
                    ("RLIMIT_AS", (lim["memory_mb"] << 20,) * 2), ("RLIMIT_FSIZE", (lim["file_bytes"],) * 2),
                    ("RLIMIT_NOFILE", (lim["open_files"],) * 2), ("RLIMIT_CORE", (0, 0))):
    resource.setrlimit(getattr(resource, name), value)
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
if spec["network_namespace"]:
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWNET | CLONE_NEWUSER
    if libc.unshare(flags) != 0:
        sys.exit("sandbox: unshare(network) failed: " + os.strerror(ctypes.get_errno()))
if spec["disk_limit"]:  # the working folder becomes a tmpfs of disk_bytes, in a mount namespace of its own
    work, uid = spec["workdir"], spec["uid"]
    files = {name: open(os.path.join(work, name), "rb").read() for name in os.listdir(work)}
    MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 1 << 18
    options = "size=%d,mode=0700,uid=%d,gid=%d" % (lim["disk_bytes"], uid or 0, uid or 0)
    if (libc.unshare(0x00020000) != 0 or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0
            or libc.mount(b"tmpfs", work.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()) != 0):
        sys.exit("sandbox: the working folder's tmpfs failed: " + os.strerror(ctypes.get_errno()))
    for name, data in files.items():
        with open(os.path.join(work, name), "wb") as f:
            f.write(data)
        if uid is not None:
            os.chown(os.path.join(work, name), uid, uid)
if spec["uid"] is not None:
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"],) * 2)
    os.setgroups([]); os.setgid(spec["uid"]); os.setuid(spec["uid"])
elif os.geteuid() != 0:  # the limit counts every process of this user: allow what it runs now, plus the program's
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["user_processes"] + lim["processes"],) * 2)
if spec["landlock"]:
    abi = spec["landlock"]
    FS_ALL = (1 << (16 if abi >= 5 else 15 if abi >= 3 else 14 if abi >= 2 else 13)) - 1
    READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
    class Ruleset(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]
    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
    attr = Ruleset(FS_ALL, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)  # no TCP bind/connect; scoped signals
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(444, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        sys.exit("sandbox: landlock_create_ruleset failed: " + os.strerror(ctypes.get_errno()))
    writable = [(spec["workdir"], FS_ALL), ("/dev/null", READ | 2)]  # 2: write a file
    for path, allowed in [(p, READ) for p in spec["readable"]] + writable:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rights = allowed if os.path.isdir(path) else allowed & 0b111  # files take only file rights
        rule = PathBeneath(rights & FS_ALL, fd)
        if libc.syscall(445, ruleset, 1, ctypes.byref(rule), 0) != 0:
            sys.exit("sandbox: landlock_add_rule failed for " + path + ": " + os.strerror(ctypes.get_errno()))
        os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(446, ruleset, 0) != 0:  # no_new_privs, restrict_self
        sys.exit("sandbox: landlock_restrict_self failed: " + os.strerror(ctypes.get_errno()))
if spec["seccomp"]:  # socket(AF_UNIX) fails (EACCES): no host socket (D-Bus, a container runtime's) is reachable
    arch, nr = spec["seccomp"]
    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]
    LD, JEQ, RET, ALLOW, EACCES = 0x20, 0x15, 0x06, 0x7FFF0000, 0x00050000 | 13
    code = [(LD, 0, 0, 4), (JEQ, 0, 4, arch), (LD, 0, 0, 0), (JEQ, 0, 2, nr), (LD, 0, 0, 16), (JEQ, 1, 0, 1),
            (RET, 0, 0, ALLOW), (RET, 0, 0, EACCES)]  # arch? socket()? its domain AF_UNIX (1)? then EACCES
    filters = (Filter * len(code))(*[Filter(*c) for c in code])
    program = Program(len(code), filters)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(program), 0, 0) != 0:  # SECCOMP_MODE_FILTER
        sys.exit("sandbox: seccomp failed: " + os.strerror(ctypes.get_errno()))
os.chdir(spec["workdir"])
os.execve(spec["python"], [spec["python"], "-I", "-B", spec["program"]], spec["env"])
"""


SECCOMP_SOCKET = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
"""Machine -> (its seccomp audit architecture, the number of the socket() system call)."""


def _seccomp_socket() -> tuple[int, int] | None:
    """What the launcher's seccomp filter needs on this machine (None: a platform it does not know)."""
    import platform

    return SECCOMP_SOCKET.get(platform.machine()) if sys.platform.startswith("linux") else None


def _landlock_abi() -> int:
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    return max(int(abi), 0)


def _spec(
    workdir: Path,
    python: str,
    limits: Limits,
    uid: int | None = None,
    landlock: int = 0,
    network_namespace: bool = False,
    env: dict | None = None,
    seccomp: tuple[int, int] | None = None,
    disk_limit: bool = False,
) -> dict:
    """What the launcher reads: the limits, the confinement to apply, the program to exec and its environment."""
    return {
        "limits": asdict(limits),
        "network_namespace": network_namespace,
        "seccomp": seccomp,
        "disk_limit": disk_limit,
        "uid": uid,
        "landlock": landlock,
        "readable": list(_readable(python)) if landlock else [],
        "workdir": str(workdir),
        "python": python,
        "program": str(workdir / "main.py"),
        "env": env or {},
        "user_processes": 0 if uid is not None else _user_processes(),
    }


def _launcher(spec: dict) -> list[str]:
    """The command that confines itself by `spec` and execs the program (no site: the launcher needs the stdlib)."""
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(spec)]


def _probe(**confinement) -> bool:
    """Can a child confine itself this way here? (one tiny launcher run; nothing else is tried)"""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "main.py").write_text("pass\n")
        spec = _spec(Path(tmp), sys.executable, Limits(), **confinement)
        return subprocess.run(_launcher(spec), capture_output=True, timeout=30).returncode == 0


_ISOLATION: dict[str, object] | None = None


def isolation() -> dict[str, object]:
    """The mechanisms this machine grants a sandboxed program: `landlock` (its ABI version, 0: none),
    `network_namespace`, `unix_sockets` (a seccomp filter refusing socket(AF_UNIX): no pathname or abstract Unix
    socket of the host reachable), `separate_user` (running as root: a user id per slot, so the process limit
    holds), `disk_limit` (as root: the working folder a tmpfs of `Limits.disk_bytes`, all files together)."""
    global _ISOLATION
    if _ISOLATION is None:
        abi, root = _landlock_abi(), hasattr(os, "geteuid") and os.geteuid() == 0
        _ISOLATION = {
            "landlock": abi if abi and _probe(landlock=abi) else 0,
            "network_namespace": sys.platform.startswith("linux") and _probe(network_namespace=True),
            "unix_sockets": bool(_seccomp_socket()) and _probe(seccomp=_seccomp_socket()),
            "separate_user": root,
            "disk_limit": root and _probe(disk_limit=True),
        }
    return dict(_ISOLATION)


@functools.cache
def _readable(python: str) -> tuple[str, ...]:
    """What a program may read: the system's folders and its interpreter's installation (looked up once)."""
    prefixes = {sys.base_prefix, sys.prefix, str(Path(python).resolve().parent.parent)}
    system = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/proc/self", "/dev/urandom", "/dev/zero"]
    return tuple(p for p in system + sorted(prefixes) if os.path.exists(p))


def _reachable_by(path: str, uid: int) -> bool:
    """Can user `uid` (not its owner) traverse to and execute `path`? (every folder on the way world-searchable)"""
    real = Path(path).resolve()
    for folder in real.parents:
        if folder.stat().st_uid != uid and not folder.stat().st_mode & 0o001:
            return False
    return bool(real.stat().st_mode & 0o005 == 0o005)


@functools.cache
def sandbox_python(uid: int | None) -> str:
    """The interpreter programs run under: this one, unless the sandbox user cannot reach it, then python3's (looked
    up once per user)."""
    if uid is None or _reachable_by(sys.executable, uid):
        return sys.executable
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system is None or not _reachable_by(system, uid):
        raise RuntimeError(f"no Python interpreter the sandbox user {uid} can run ({sys.executable} is not reachable)")
    return system


class Sandbox:
    """Runs programs under `limits`, up to `workers` at a time (`run_many`), each in its own process and folder.

    `require`: isolation mechanisms (keys of `isolation()`) it must have, else it refuses to start (e.g. a
    training run that executes model-written code on a shared machine)."""

    def __init__(self, limits: Limits = Limits(), workers: int = 4, require: tuple[str, ...] = ()):
        self.limits, self.workers = limits, workers
        self.isolation = isolation()
        missing = [name for name in require if not self.isolation.get(name)]
        if missing:
            raise RuntimeError(f"the sandbox needs {', '.join(missing)}, which this machine does not grant")
        self._slots = list(range(workers))
        self._uids = _claim_uids(workers) if self.isolation["separate_user"] else []  # (uid, its lock) per slot
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
        # A pool dropped unclosed (a reward's or a tool's, when its run ends) gives its threads and ids back too.
        self._release = weakref.finalize(self, _release, self._pool, self._uids)

    def run(self, source: str, files: dict[str, str] | None = None) -> Execution:
        """Run `source` as main.py (with `files` beside it) in a fresh folder; what it did."""
        with self._lock:
            slot = self._slots.pop()
        try:
            return self._run(source, files or {}, slot)
        finally:
            with self._lock:
                self._slots.append(slot)

    def run_many(self, sources: list[str]) -> list[Execution]:
        return self.map(self.run, sources)

    def map(self, fn, items: list) -> list:
        """`fn(item)` for every item on the pool's threads (each `fn` calls `run`), in order."""
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        self._release()

    def _run(self, source: str, files: dict[str, str], slot: int) -> Execution:
        uid = self._uids[slot][0] if self._uids else None
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="tierlm-sandbox-") as tmp:
            root = Path(tmp)  # 0700, the trainer's: holds the output files and the work folder
            work = root / "work"
            work.mkdir()
            for name, text in {**files, "main.py": source}.items():
                (work / name).write_text(text)
            if uid is not None:
                for path in [work, *work.iterdir()]:
                    os.chown(path, uid, uid)
                root.chmod(0o711)  # the sandbox user may pass through to work/, not list or read the rest
            try:
                python = sandbox_python(uid)
            except RuntimeError as e:
                return Execution("refused", None, "", str(e), 0.0)
            env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
            grants = self.isolation
            spec = _spec(work, python, self.limits, uid, grants["landlock"], grants["network_namespace"], env,
                         _seccomp_socket() if grants["unix_sockets"] else None, grants["disk_limit"])  # fmt: skip
            with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
                proc = subprocess.Popen(
                    _launcher(spec),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,  # its own process group, killed whole
                    close_fds=True,
                )
                try:
                    proc.wait(timeout=self.limits.wall_seconds)
                    status = None
                except subprocess.TimeoutExpired:
                    status = "timeout"
                finally:
                    _kill_group(proc.pid)
                    proc.wait()
                    if uid is not None:
                        _kill_user(uid)  # whatever escaped the group (a daemon that called setsid)
            code = proc.returncode
            if status is None:
                status = "ok" if code == 0 else "killed" if code < 0 else "error"
            read = lambda name: (root / name).read_bytes()[: self.limits.file_bytes].decode(errors="replace")  # noqa: E731
            return Execution(status, code, read("stdout"), read("stderr"), time.perf_counter() - start)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_all_command(uid: int) -> list[str]:
    """A command that, run as `uid`, SIGKILLs every process of that user but itself (kill(-1); Linux spares the
    caller): the system's `kill` (3 ms), else a short interpreter (22 ms)."""
    kill = shutil.which("kill", path="/usr/bin:/bin")
    if kill is not None:
        return [kill, "-KILL", "-1"]
    return [sandbox_python(uid), "-I", "-S", "-c", "import os, signal; os.kill(-1, signal.SIGKILL)"]


def _kill_user(uid: int, patience_s: float = 2.0) -> None:
    """SIGKILL every process of `uid` (a pool slot's user, which nothing else runs as) and wait until none is left
    running (zombies aside). The kill runs as that user in a process `subprocess` starts, whose fork runs no Python in
    the child: `os.fork()` would run the trainer's fork handlers (JAX's warns of a deadlock) and Python code in a copy
    of a process whose other threads held what they held."""
    deadline = time.monotonic() + patience_s
    command = _kill_all_command(uid)
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        subprocess.run(command, user=uid, group=uid, extra_groups=[], check=False, **quiet)
        if not _running_as(uid) or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _user_processes() -> int:
    """Threads this user runs now (what RLIMIT_NPROC counts), from /proc."""
    uid, total = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    total += len(os.listdir(os.path.join(entry.path, "task")))
            except (FileNotFoundError, PermissionError):
                continue
    return total


def _running_as(uid: int) -> list[int]:
    """Processes of `uid` that are not zombies."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid and "\nState:\tZ" not in Path(entry.path, "status").read_text():
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found
