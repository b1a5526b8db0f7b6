"""One RL step, split: generation / scoring (old and reference log-probs) / training / weight sync, and rollout
tokens/s — on-policy against one step off-policy (the next batch sampled while this one trains), one process
against 2 ranks (DDP, FSDP2), tierlm's engine against vLLM (in the trainer's process, from .venv-vllm; and a
vLLM server on the same cores, scripts/vllm_server.sh), all on the tiny task from the same SFT model.

    .venv/bin/python bench/rl.py [--repeats 3] [--steps 12] [--sft runs/tiny_sft] [--max-new-tokens 96]
    bash bench/sums_sft.sh && .venv/bin/python bench/rl.py --task synthetic:sums --sft runs/sums/sft \
        --max-new-tokens 256 --only "1 process on-policy,1 process partial rollouts"   # a heavy tail

Partial rollouts (`rl.partial_rollouts`) against the plain step: with --max-new-tokens well above the usual answer
(about 10-25 tokens) a few samples ramble on to the budget, so a plain step waits for them (a heavy tail). Every
contender reports the share of the step the sampler is idle: on-policy, the step minus generation; one step off,
the step minus the background sampler's own time on the batch.

Each contender is `tierlm rl --config tiny_rl` for --steps steps (eval only at the end, no checkpoints but the
last) in its own process (torchrun for the 2-rank ones); the figures are medians over its steps after the first
two (warm-up). Without --sft, a tiny SFT model is trained once into the system's temp folder (about a minute).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SFT_DIR = Path(tempfile.gettempdir()) / "tierlm_bench_rl_sft"


def sft_model(args) -> Path:
    if args.sft:
        return Path(args.sft)
    if not (SFT_DIR / "sft" / "model").is_dir():
        common = ["infra.device_type=cpu", "infra.progress_bar=false"]
        for stage, config, extra in (
            ("pretrain", "configs/tiny_pretrain.yaml", []),
            ("sft", "configs/tiny_sft.yaml", [f"model.model_name_or_path={SFT_DIR / 'pretrain'}"]),
        ):
            out = SFT_DIR / stage
            command = [sys.executable, "-m", "tierlm", stage, "--config", config, *common, *extra]
            subprocess.run([*command, f"infra.output_dir={out}"], cwd=REPO, check=True, capture_output=True)
    return SFT_DIR / "sft"


VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"


def vllm_python() -> str:
    if not VLLM_PY.is_file():
        raise SystemExit(
            "no .venv-vllm (bash scripts/setup_vllm.sh makes it): leave the vLLM contenders out with --only"
        )
    return str(VLLM_PY)


def with_server(args, extra: list[str]) -> dict:
    """The step with a vLLM server (scripts/vllm_server.sh, its own process on the same cores) sampling."""
    import signal
    import socket
    import time
    import urllib.request

    vllm_python()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = sft_model(args) / "model"
    server = subprocess.Popen(
        ["bash", "scripts/vllm_server.sh", str(folder), str(port), "--max-model-len", "256"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Not a session of its own: started with setsid, the server on these same two cores made the trainer's
        # scoring 1.0 s a step instead of 0.04 s (measured; the kernel's per-session CPU grouping is the suspect).
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None, "the vLLM server stopped"
                time.sleep(1)
        return rl_step(args, 1, ["engine.kind=vllm", f"engine.vllm_url={url}", *extra])
    finally:
        server.send_signal(signal.SIGTERM)  # the script execs vLLM's server, which stops its engine process
        server.wait()


def rl_step(args, ranks: int, extra: list[str], python: str = sys.executable) -> dict:
    out = Path(tempfile.mkdtemp(prefix="tierlm_bench_rl_"))
    overrides = [
        f"model.model_name_or_path={sft_model(args)}",
        f"training.num_train_steps={args.steps}",
        "training.eval_steps=0",
        "training.save_steps=0",
        "training.logging_steps=1",
        "rl.eval_problems=8",
        "infra.device_type=cpu",
        "infra.progress_bar=false",
        f"infra.output_dir={out}",
        *([f"rl.max_new_tokens={args.max_new_tokens}"] if args.max_new_tokens else []),
        *([f"data.dataset_name={args.task}"] if args.task else []),
        *extra,
    ]
    tierlm = ["-m", "tierlm", "rl", "--config", "configs/tiny_rl.yaml", *overrides]
    if ranks > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        per_rank = str(max(1, args.threads // ranks))  # the ranks share the threads (BLAS's too)
        env = {**os.environ, "OMP_NUM_THREADS": per_rank, "MKL_NUM_THREADS": per_rank}
        command = [sys.executable, *launcher, *tierlm]
    else:
        env, command = os.environ, [python, *tierlm]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    steady = train[2:]
    walls = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(train[1:], train[2:])]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in steady)

    step = statistics.median(walls)
    sampler = median("time_sampling_s") if "time_sampling_s" in steady[0] else median("time_generation_s")
    return {
        "seconds_per_step": step,
        "sampler_idle_share": max(0.0, 1.0 - sampler / step),
        "completion_len": median("completion_len"),
        "stale_dropped_per_step": statistics.mean(r.get("stale_dropped", 0.0) for r in steady),
        "finished_frac": median("finished_frac"),
        "generation_s": median("time_generation_s"),
        "scoring_s": median("time_scoring_s"),
        "training_s": median("time_training_s"),
        "weight_sync_s": median("time_weight_sync_s"),
        "rollout_tokens_per_sec": median("rollout_tokens_per_sec"),
        "reward_mean": statistics.mean(r["reward_mean"] for r in train),
    }


CONTENDERS = {
    "1 process on-policy": lambda a: rl_step(a, 1, []),
    "1 process one step off": lambda a: rl_step(a, 1, ["rl.max_off_policy_steps=1"]),
    "2 ranks DDP on-policy": lambda a: rl_step(a, 2, ["infra.distributed_type=ddp"]),
    "2 ranks FSDP2 on-policy": lambda a: rl_step(a, 2, ["infra.distributed_type=fsdp"]),
    "1 process partial rollouts": lambda a: rl_step(a, 1, ["rl.partial_rollouts=true"]),
    "1 process partial + one step off": lambda a: rl_step(
        a, 1, ["rl.partial_rollouts=true", "rl.max_off_policy_steps=1"]
    ),
    "1 process vLLM in process": lambda a: rl_step(a, 1, ["engine.kind=vllm"], vllm_python()),
    "1 process vLLM partial rollouts": lambda a: rl_step(
        a, 1, ["engine.kind=vllm", "rl.partial_rollouts=true"], vllm_python()
    ),
    "1 process vLLM server": lambda a: with_server(a, []),
}

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sft", default=None, help="an SFT run directory (default: trained once into the temp folder)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="rl.max_new_tokens (default: tiny_rl's 32)")
    p.add_argument("--task", default=None, help="data.dataset_name (default: tiny_rl's synthetic:arithmetic)")
    args = p.parse_args()
    argv = [f"--steps={args.steps}", f"--threads={args.threads}", *([f"--sft={args.sft}"] if args.sft else [])]
    argv += [f"--max-new-tokens={args.max_new_tokens}"] if args.max_new_tokens else []
    argv += [f"--task={args.task}"] if args.task else []
    if args.contender is None:
        sft_model(args)
        print(f"tierlm rl, tiny_rl, {args.steps} steps, {args.threads} threads in all", file=sys.stderr)
    run(CONTENDERS, args, argv, "seconds_per_step", "1 process on-policy")
