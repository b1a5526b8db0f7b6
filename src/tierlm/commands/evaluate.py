"""`tierlm eval --checkpoint RUN [--config RL_CONFIG]`: pass@1 / pass@k of a chat model on the held-out
tasks an RL config names, sampled by the generation engine (no training); `--core BUNDLE`: CORE of a base model."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from tierlm.builders.engine import build_engine
from tierlm.builders.tasks import open_tasks
from tierlm.checkpoint.folders import verified_model_location
from tierlm.config import TierlmConfig
from tierlm.data import load_tokenizer
from tierlm.errors import ConfigError
from tierlm.loops.evaluation import evaluate_core, evaluate_pass_at_k
from tierlm.loops.sampling import RolloutSampler
from tierlm.models import load_pretrained_model
from tierlm.primitives import resolve_device
from tierlm.tasks.formats import chance_level


def run_eval(config: TierlmConfig, checkpoint: str) -> dict:
    """pass@1 / pass@k of a chat model on the held-out problems the RL config names (no training)."""
    location = verified_model_location(checkpoint)
    tokenizer = load_tokenizer(location, config.model.trust_remote_code)
    if not tokenizer.has_chat_template:
        raise ConfigError(f"{checkpoint} has no chat template: pass@k evaluates chat models")
    torch.manual_seed(config.training.seed)
    model = load_pretrained_model(location, device=resolve_device(config.infra.device_type, config.infra.gpu_rank))
    eval_task = open_tasks(config)[1]
    with tempfile.TemporaryDirectory(prefix="tierlm-sampler-") as folder:  # rl.engine=vllm: its model folder
        engine = build_engine(config.rl, model, tokenizer, Path(folder), task=eval_task)
        try:
            return evaluate_pass_at_k(RolloutSampler(engine, tokenizer, config.rl, config.training.seed), eval_task)
        finally:
            engine.close()


def run_core(checkpoint: str, bundle: str, limit: float | None, device_type: str = "auto") -> str:
    """CORE of a model on a local eval bundle: the table of tasks; a run directory also gets a `core` line in its
    metrics.jsonl (at its last step), core.json and a table in report.md."""
    if limit is not None and limit != int(limit):
        raise ConfigError(f"--limit with --core counts items per task: give a whole number, not {limit}")
    location = verified_model_location(checkpoint)
    device = resolve_device(device_type, 0)
    model = load_pretrained_model(location, device=device)
    result = evaluate_core(model, load_tokenizer(location), bundle, int(limit) if limit else None, device)
    record_core(location, bundle, result)
    return _core_table(result, "CORE")


def _core_table(result: dict, name: str) -> str:
    rows = [f"{label:<32} {r['accuracy']:.4f} {r['centered']:+.4f} ({r['items']} items)" for label, r in
            result["tasks"].items()]  # fmt: skip
    return "\n".join(["task                             accuracy centred", *rows, f"{name} {result['core']:.4f}"])


def record_core(location, source: str, result: dict, kind: str = "core") -> None:
    """When `location` is a run's final model: a `core` (or `chat_core`) line in its metrics.jsonl, `<kind>.json`
    and its report.md rebuilt (`tierlm.metrics.report.record_evaluation`)."""
    from tierlm.metrics.report import record_evaluation, run_of

    run = run_of(location)
    if run is not None:
        record = {"type": kind, "core": result["core"], "tasks": result["tasks"]}
        record_evaluation(run, record, f"{kind}.json", {"source": str(source), **result})


def run_chat_core(checkpoint: str, tasks: dict[str, str], limit: float | None, device_type: str = "auto") -> str:
    """ChatCORE-style accuracy of a chat model (nanochat's chat evaluation): greedy pass@1 on the held-out examples
    of each named task source (any layout of `tierlm.tasks.formats`, or `synthetic:<name>`), centred on its chance
    level (1 / options for multiple choice, 0 otherwise), and their mean. A run directory records it as CORE's."""
    if limit is not None and limit != int(limit):
        raise ConfigError(f"--limit with --chat-core counts problems per task: give a whole number, not {limit}")
    location = verified_model_location(checkpoint)
    tokenizer = load_tokenizer(location)
    if not tokenizer.has_chat_template:
        raise ConfigError(f"{checkpoint} has no chat template: ChatCORE evaluates chat models (CORE: --core)")
    model = load_pretrained_model(location, device=resolve_device(device_type, 0))
    results = {}
    for name, source in tasks.items():
        settings = [f"data.dataset_name={source}", f"data.eval_dataset_name={source}", "rl.eval_temperature=0"]
        config = TierlmConfig.load("tiny_rl", [*settings, "rl.eval_k=1"])  # its evaluation split, whole
        eval_task = open_tasks(config)[1]
        n = len(eval_task) if limit is None else min(int(limit), len(eval_task))
        config.rl.eval_problems = n
        chance = sum(chance_level(eval_task.example(i)) for i in range(n)) / max(n, 1)
        with tempfile.TemporaryDirectory(prefix="tierlm-sampler-") as folder:
            engine = build_engine(config.rl, model, tokenizer, Path(folder))
            try:
                sampler = RolloutSampler(engine, tokenizer, config.rl, config.training.seed)
                accuracy = evaluate_pass_at_k(sampler, eval_task)["pass@1"]
            finally:
                engine.close()
        results[name] = {"accuracy": accuracy, "centered": (accuracy - chance) / (1 - chance), "items": n}
    result = {"tasks": results, "core": sum(r["centered"] for r in results.values()) / max(len(results), 1)}
    record_core(location, ",".join(f"{k}={v}" for k, v in tasks.items()), result, kind="chat_core")
    return _core_table(result, "ChatCORE")
