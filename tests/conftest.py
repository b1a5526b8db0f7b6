import contextlib
import gc
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

collect_ignore = [str(Path(__file__).parents[1] / "src" / "tierlm" / "__main__.py")]

REPO = Path(__file__).resolve().parents[1]

# Nothing downloads in tests: a name that could be a Hub id fails at once instead of retrying the network
# (the CLI's subprocesses inherit it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Runs draw no report as they go (`tierlm.metrics.report.reports_on`: matplotlib's second or so at every run's end
# was a fifth of an end-to-end test's time); the tests of the report itself ask for it (the `reports` fixture).
os.environ.setdefault("TIERLM_REPORT", "off")

# Under pytest-xdist (scripts/test.sh runs two workers on two cores) each worker and every process it starts computes
# on one thread: two workers with a thread per core each would take the cores from each other many times over.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _memory_traces(tmp_path_factory):
    """The memory planner keeps its traced steps on disk (`tierlm.plan.memory.traces`): the suite keeps its own,
    fresh each run, shared by its workers and every process they start."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ.setdefault("TIERLM_CACHE_DIR", str(shared / "tierlm-cache"))


@pytest.fixture
def reports(monkeypatch):
    """Runs in this test (and the processes it starts) draw their report.md and plots/ as users' runs do."""
    monkeypatch.setenv("TIERLM_REPORT", "on")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


_tests_since_collection = [0]


@pytest.fixture(autouse=True)
def _suite_frozen():
    """What the suite's process held before this test stays out of the garbage collector's passes during it
    (`gc.freeze()`: moved to the permanent generation, in constant time), as a user's process holds only its own
    run. A run collects fully after its first step (`Trainer._collect_garbage`): in a test worker holding every
    module and test the suite imported, that pass took 0.29 s, a sixth of tests/test_rl.py and
    tests/test_model_families.py. Given back after the test (the run's own unfreeze gives back everything anyway),
    and a full collection every 40 tests takes what cycles the tests left."""
    gc.freeze()
    yield
    gc.unfreeze()
    _tests_since_collection[0] += 1
    if _tests_since_collection[0] % 40 == 0:
        gc.collect()


def pytest_sessionfinish(session):
    """The session's garbage is collected once, here, and what survives is frozen: pytest's own clean-up then collects
    five more times (for unraisable exceptions), each pass over a worker's whole heap (every module and run the suite
    left, millions of objects) unless frozen. Under pytest-xdist those passes come after the worker has reported it
    finished, and execnet gives a worker 5 s to end before it sends the worker a SIGINT: the KeyboardInterrupt then
    surfaced inside whatever ran, JAX's garbage-collection callback, at the end of every run."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _signal_handlers_given_back():
    """A test leaves the stop signals' handlers as it found them: a test worker goes on after it, and a `GracefulStop`
    left installed turns the worker's own shutdown (a SIGINT) into a KeyboardInterrupt inside whatever runs then."""
    import signal

    from tierlm.loops.signals import STOP_SIGNALS

    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    changed = [sig.name for sig in STOP_SIGNALS if signal.getsignal(sig) != before[sig]]
    for sig, handler in before.items():
        signal.signal(sig, handler)
    assert not changed, f"the test left {', '.join(changed)} with another handler (tierlm.loops.signals)"


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tierlm.data import ArithmeticTask, train_bpe_tokenizer

    texts = [p.text for p in ArithmeticTask().problems("train", 2000, seed=0)]
    return train_bpe_tokenizer(texts, vocab_size=300)


@pytest.fixture
def tiny_gpt_config():
    from tierlm.models import GPTConfig

    return GPTConfig(depth=2, aspect_ratio=32, head_dim=16, n_kv_head=2, vocab_size=97, max_seq_len=64)


def cli_env() -> dict[str, str]:
    """The environment a test's `tierlm` process gets: this one's, its thread count (2 unless set: one each under
    pytest-xdist) and no warnings printed."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONWARNINGS": "ignore"}


def run_cli(*args, cwd=None, timeout=600):
    """Run `python -m tierlm ARGS` in a fresh process (one thread each: tests run serially on 2 cores)."""
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "tierlm", *map(str, args)],
        cwd=cwd or REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_main(*args, timeout=None):
    """`tierlm ARGS` by tierlm's `main` in this process, its output captured: `run_cli`'s result where the process
    boundary is not what a test checks (a fresh interpreter costs seconds of imports each time). `timeout` is
    `run_cli`'s, unused here."""
    import contextlib
    import io
    import subprocess

    from tierlm.commands.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's refusals
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["tierlm", *map(str, args)], code, out.getvalue(), err.getvalue())


def first_failure(stderr: str) -> str:
    """A failed torchrun's story: the first rank's first error (which the last lines, the other ranks' broken
    connections, hide), then the end.

    >>> first_failure("noise\\nTraceback (most recent call last):\\n  boom\\nmore")[:9]
    'Traceback'
    """
    starts = [i for i in (stderr.find("Traceback"), stderr.find("Fatal Python error")) if i >= 0]
    head = stderr[min(starts) : min(starts) + 3000] if starts else ""
    return f"{head}\n...\n{stderr[-2000:]}"


def torchrun(*args, nproc: int = 2, timeout: int = 300, wait: bool = True, **popen):
    """Run `python -m torch.distributed.run --standalone --nproc_per_node NPROC ARGS` (one thread per rank);
    `wait=False`: start it in its own process group (for os.killpg) and return the process."""
    import subprocess

    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # a worktree's src first
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts (SIGABRT, SIGSEGV) prints every thread's Python stack
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        *map(str, args),
    ]
    if not wait:
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True, **quiet, **popen)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, **popen)


def digits_reward(folder: Path, monkeypatch) -> str:
    """The `rl.reward=...` of a reward for digits (0.25 a digit), importable here and in the runs this test starts:
    the tiny models never answer right, so with the task's own reward every advantage is 0 and no step moves the
    weights — an exact-resume check would pass whatever the resume trained on."""
    (folder / "digits_reward.py").write_text(
        "def reward(prompt, completion, reference):\n    return 0.25 * sum(c.isdigit() for c in completion)\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    return "rl.reward=digits_reward:reward"


def two_domain_task(folder: Path, count: int = 200) -> list[str]:
    """The overrides of an RL task of two domains: the synthetic arithmetic problems as JSONL rows whose `domain` is
    "add" or "sub" by their operation (what rl.teachers routes by)."""
    import json

    from tierlm.builders.tasks import open_task

    task = open_task("synthetic:arithmetic", "train", count, seed=0)
    rows = []
    for i in range(count):
        example = task.example(i)
        domain = "add" if "+" in example.prompt else "sub"
        rows.append({"question": example.prompt, "answer": str(example.reference), "domain": domain})
    path = folder / "two_domains.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [f"data.dataset_name={path}", "data.val_fraction=0.1"]


def kill_at_checkpoint(args, output_dir: Path, step: int) -> None:
    """Start `tierlm ARGS infra.output_dir=OUTPUT_DIR` (forked from the preloaded process, tests/forked.py), SIGKILL
    it the moment checkpoint `step` is the latest, and check it really died mid-run."""
    import signal
    import time

    from tests.forked import start

    proc = start("-m", "tierlm", *args, f"infra.output_dir={output_dir}", env=cli_env())
    latest, deadline = output_dir / "checkpoints" / "latest", time.time() + 300
    while not (latest.is_file() and latest.read_text().strip() == f"step_{step}"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before the checkpoint"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"


def resume_from_checkpoint(args, output_dir: Path, step: int, in_process: bool = False):
    """Roll a finished `tierlm ARGS infra.output_dir=OUTPUT_DIR` run back to checkpoint `step` (later
    checkpoints and the final model removed) and resume it to the end; returns the resumed process (`in_process`:
    run by tierlm's `main` in this process, where the process boundary is not what is tested; returns None)."""
    import shutil

    for checkpoint in (output_dir / "checkpoints").glob("step_*"):
        if int(checkpoint.name.split("_")[1]) > step:
            shutil.rmtree(checkpoint)
    shutil.rmtree(output_dir / "model")
    (output_dir / "checkpoints" / "latest").write_text(f"step_{step}\n")
    if in_process:
        from tierlm.commands.cli import main

        assert main([*map(str, args), f"infra.output_dir={output_dir}", "--resume"]) == 0
        return None
    result = run_cli(*args, f"infra.output_dir={output_dir}", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# Tiny CLI-sized runs (seconds on 2 cores) for tests that need a trained run directory.
TINY = [
    "model.depth=1",
    "model.aspect_ratio=32",
    "model.head_dim=32",
    "tokenizer.vocab_size=300",
    "tokenizer.num_train_docs=200",
    "data.num_synthetic_examples=200",
    "data.num_synthetic_eval_examples=16",
    "data.max_seq_length=32",
    "training.num_train_steps=2",
    "training.warmup_steps=0",
    "training.eval_steps=0",
    "training.eval_batches=1",
    "training.per_device_train_batch_size=4",
    "infra.progress_bar=false",
    "infra.device_type=cpu",
    "infra.output_dir=out",
]
CHAT = [
    "data.max_seq_length=64",
    "training.num_train_steps=2",
    "training.warmup_steps=0",
    "training.eval_steps=0",
    "training.eval_batches=1",
    "training.per_device_train_batch_size=4",
    "infra.progress_bar=false",
    "infra.device_type=cpu",
    "infra.output_dir=out",
    "data.num_synthetic_examples=64",
    "data.num_synthetic_eval_examples=8",
]
RL = [*CHAT, "rl.prompts_per_step=2", "rl.group_size=2", "rl.eval_problems=2", "rl.eval_k=2", "rl.max_new_tokens=4"]

PREFERENCE_CASES = [  # dpo.loss_type and its settings: each is tested against its formula and (but for the
    # reference-free simpo and orpo, which TRL's DPOTrainer does not compute) against TRL's DPOTrainer
    ("sigmoid", {}),
    ("robust", {"label_smoothing": 0.2}),
    ("hinge", {}),
    ("ipo", {}),
    ("simpo", {"simpo_gamma": 0.7, "beta": 2.0}),
    ("orpo", {}),
    ("sigmoid_norm", {}),
    ("exo_pair", {"label_smoothing": 1e-3}),
    ("nca_pair", {}),
    ("bco_pair", {}),
    ("sppo_hard", {}),
    ("apo_zero", {}),
    ("apo_down", {}),
    ("discopop", {"discopop_tau": 0.3}),
    # f-DPO (TRL's f_divergence_type) under the losses that read it
    ("sigmoid", {"f_divergence_type": "js_divergence"}),
    ("hinge", {"f_divergence_type": "forward_kl"}),
    ("robust", {"label_smoothing": 0.2, "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}),
    ("exo_pair", {"label_smoothing": 1e-3, "f_divergence_type": "js_divergence"}),
    ("discopop", {"discopop_tau": 0.3, "f_divergence_type": "alpha_divergence"}),
]


def _pretrain_and_sft(root: Path, *pretrain: str) -> Path:
    """`root`/pre (tiny_pretrain with TINY and `pretrain`) and `root`/sft (tiny_sft from it)."""
    from tierlm.config import TierlmConfig
    from tierlm.stages import run_stage

    pre, sft = root / "pre", root / "sft"
    run_stage(
        TierlmConfig.load(REPO / "configs/tiny_pretrain.yaml", [*TINY, *pretrain, f"infra.output_dir={pre}"]),
        "pretrain",
    )
    run_stage(
        TierlmConfig.load(
            REPO / "configs/tiny_sft.yaml", [*CHAT, f"model.model_name_or_path={pre}", f"infra.output_dir={sft}"]
        ),
        "sft",
    )
    return root


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    """A tiny pretrain run and an SFT run from it, shared (read-only) by the cases."""
    return _pretrain_and_sft(tmp_path_factory.mktemp("runs"), "training.num_train_steps=3")


@pytest.fixture(scope="session")
def two_block_runs(tmp_path_factory):
    """The same at depth 2 (two blocks of two heads: one block per pipeline stage, one head per tensor-parallel
    rank), shared (read-only) by the model-parallel cases."""
    return _pretrain_and_sft(tmp_path_factory.mktemp("two_block_runs"), "model.depth=2")


def free_port() -> int:
    """A local TCP port nothing listens on now (the kernel's pick): rendezvous and servers in tests take one instead
    of a fixed port another test beside them may hold."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(app):
    """An ASGI app (`tierlm serve`'s) served by uvicorn on a free local port, on a thread: its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    try:
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def pytest_collection_modifyitems(config, items):
    """The longest files first (their seconds in tests/durations.json, written by scripts/test_durations.py from a
    whole run; a file not in it counts as a middling one), so the two workers of scripts/test.sh (`--dist loadfile
    --no-loadscope-reorder`) end together instead of one idling while the other runs a long file dealt last (the
    longest-processing-time rule). Every worker sorts alike, so their collections agree."""
    import json

    table = Path(__file__).with_name("durations.json")
    seconds = json.loads(table.read_text()) if table.is_file() else {}
    unknown = sorted(seconds.values())[len(seconds) // 2] if seconds else 0.0
    order = {item.nodeid.split("::")[0]: i for i, item in reversed(list(enumerate(items)))}  # first appearance
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], unknown), order[item.nodeid.split("::")[0]]))
