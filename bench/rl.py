"""One RL step, split: generation / scoring (old and reference log-probs) / training / weight sync, and rollout
tokens/s — on-policy against one step off-policy (the next batch sampled while this one trains), one process
against 2 ranks (DDP, FSDP2), tierlm's engine against vLLM (in the trainer's process, from .venv-vllm; and a
vLLM server on the same cores, scripts/vllm_server.sh), all on the tiny task from the same SFT model.

    .venv/bin/python bench/rl.py [--repeats 3] [--steps 12] [--sft runs/tiny_sft] [--max-new-tokens 96]
    python bench/rl.py --device-type cuda --random-model 20x64 --max-new-tokens 128 --repeats 1 \
        --only "1 process on-policy,1 process on-policy compiled,1 process on-policy all compiled"
                                                                      # on a GPU: a 393 M random-weight policy
    bash bench/sums_sft.sh && .venv/bin/python bench/rl.py --task synthetic:sums --sft runs/sums/sft \
        --max-new-tokens 256 --only "1 process on-policy,1 process partial rollouts"   # a heavy tail

Partial rollouts (`rl.partial_rollouts`) against the plain step: with --max-new-tokens well above the usual answer
(about 10-25 tokens) a few samples ramble on to the budget, so a plain step waits for them (a heavy tail). Every
contender reports the share of the step the sampler is idle: on-policy, the step minus generation; one step off,
the step minus the background sampler's own time on the batch.

Each contender is `tierlm rl --config tiny_rl` for --steps steps (eval only at the end, no checkpoints but the
last) in its own process (torchrun for the 2-rank ones); the figures are medians over its steps after the first
two (warm-up). Without --sft, a tiny SFT model is trained once into the system's temp folder (about a minute).
With --random-model DEPTHxASPECT the policy is a native GPT of that shape with random weights and the SFT model's
tokenizer (head 128): a GPU-sized model whose answers earn nothing, so every sample runs to --max-new-tokens and the
step's split is the cost of the sizes alone (its training still runs forward and backward; `training_mfu`).
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


POLICY: list[Path] = []


def policy_folder(args) -> Path:
    """`policy`, made once per process."""
    if not POLICY:
        POLICY.append(policy(args))
    return POLICY[0]


def policy(args) -> Path:
    """The model the run starts from: the SFT model, or a random-weight GPT of --random-model's shape beside it."""
    if not args.random_model:
        return sft_model(args)
    import shutil

    from tierlm.models import GPTConfig, build_gpt, save_model_folder

    depth, aspect = map(int, args.random_model.split("x"))
    folder = Path(tempfile.mkdtemp(prefix="tierlm_bench_rl_random_")) / "model"
    shutil.copytree(sft_model(args) / "model", folder, ignore=shutil.ignore_patterns("training_meta.json"))
    config = GPTConfig(**{**gpt_fields(folder), "depth": depth, "aspect_ratio": aspect, "head_dim": 128})
    save_model_folder(build_gpt(config), folder)
    return folder.parent


def gpt_fields(folder: Path) -> dict:
    """The GPTConfig fields of a native GPT model folder (its tierlm_model.json less the family's name)."""
    return {k: v for k, v in json.loads((folder / "tierlm_model.json").read_text()).items() if k != "family"}


def training_mfu(args, completion_tokens_per_sec: float) -> float | None:
    """The training part's model FLOPs utilisation on a GPU, counting the completion tokens alone (6 x the
    non-embedding parameters each; the prompts' tokens also run, so a lower bound)."""
    if args.device_type != "cuda":
        return None
    import torch

    from tierlm.metrics.flops import peak_flops
    from tierlm.models import GPT, GPTConfig

    with torch.device("meta"):
        params = GPT(GPTConfig(**gpt_fields(policy_folder(args) / "model"))).num_params(exclude_embedding=True)
    peak = peak_flops(torch.device("cuda"))
    return 6 * params * completion_tokens_per_sec / peak if peak else None


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
        f"model.model_name_or_path={policy_folder(args)}",
        f"training.num_train_steps={args.steps}",
        "training.eval_steps=0",
        "training.save_steps=0",
        "training.logging_steps=1",
        "rl.eval_problems=8",
        f"infra.device_type={args.device_type}",
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
        "training_mfu": training_mfu(args, median("rollout_tokens") / median("time_training_s")),
        "reward_mean": statistics.mean(r["reward_mean"] for r in train),
    }


CONTENDERS = {
    "1 process on-policy": lambda a: rl_step(a, 1, []),
    "1 process on-policy compiled": lambda a: rl_step(a, 1, ["infra.compile=true"]),
    # the whole step compiled: the training forward as one graph and the decode step (inside its CUDA graph on a GPU)
    "1 process on-policy all compiled": lambda a: rl_step(a, 1, ["infra.compile=model", "engine.compile=true"]),
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
    p.add_argument("--device-type", default="cpu", help="infra.device_type of every contender")
    p.add_argument("--random-model", default=None, metavar="DEPTHxASPECT", help="a random-weight policy (see above)")
    p.add_argument("--sft", default=None, help="an SFT run directory (default: trained once into the temp folder)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="rl.max_new_tokens (default: tiny_rl's 32)")
    p.add_argument("--task", default=None, help="data.dataset_name (default: tiny_rl's synthetic:arithmetic)")
    args = p.parse_args()
    argv = [f"--steps={args.steps}", f"--threads={args.threads}", *([f"--sft={args.sft}"] if args.sft else [])]
    argv += [f"--max-new-tokens={args.max_new_tokens}"] if args.max_new_tokens else []
    argv += [f"--task={args.task}"] if args.task else []
    argv += [f"--device-type={args.device_type}"]
    argv += [f"--random-model={args.random_model}"] if args.random_model else []
    if args.contender is None:
        sft_model(args)
        print(f"tierlm rl, tiny_rl, {args.steps} steps, {args.threads} threads in all", file=sys.stderr)
    run(CONTENDERS, args, argv, "seconds_per_step", "1 process on-policy")
