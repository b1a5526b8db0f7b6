"""`tierlm eval --checkpoint RUN [--config RL_CONFIG]`: pass@1 / pass@k of a chat model on the held-out
tasks an RL config names, sampled by the generation engine (no training); `--core BUNDLE`: CORE of a base model."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tierlm.commands.options import (
    DEVICE_TYPES,
    Command,
    add_config_args,
    named_sources,
    non_negative_int,
    positive_float,
    positive_int,
    task_list,
)
from tierlm.commands.overrides import EVAL_KEYS, check_overrides, override_key
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError


def run_eval(config: TierlmConfig, checkpoint: str) -> dict:
    """pass@1 / pass@k of a chat model on the held-out problems the RL config names (no training)."""
    import torch

    from tierlm.builders.tasks import open_tasks
    from tierlm.checkpoint.folders import verified_model_location
    from tierlm.data import load_tokenizer
    from tierlm.models import load_pretrained_model
    from tierlm.primitives import resolve_device

    location = verified_model_location(checkpoint)
    tokenizer = load_tokenizer(location, config.model.trust_remote_code)
    if not tokenizer.has_chat_template:
        raise ConfigError(f"{checkpoint} has no chat template: pass@k evaluates chat models")
    torch.manual_seed(config.training.seed)
    model = load_pretrained_model(location, device=resolve_device(config.infra.device_type, config.infra.gpu_rank))
    return held_out_pass_at_k(config, model, tokenizer, open_tasks(config, training=False)[1])


def held_out_pass_at_k(config: TierlmConfig, model, tokenizer, eval_task) -> dict:
    """pass@k of `model` on `eval_task` (`tierlm.loops.evaluation.evaluate_pass_at_k`), sampled by the engine the
    config's engine section names (with the task's tools), which is closed after."""
    from tierlm.builders.engine import EngineSettings, build_engine
    from tierlm.loops.evaluation import evaluate_pass_at_k
    from tierlm.loops.sampling import RolloutSampler

    with tempfile.TemporaryDirectory(prefix="tierlm-sampler-") as folder:  # engine.kind=vllm: its model folder
        engine = build_engine(EngineSettings.of(config), model, tokenizer, Path(folder), task=eval_task)
        try:
            return evaluate_pass_at_k(RolloutSampler(engine, tokenizer, config.rl, config.training.seed), eval_task)
        finally:
            engine.close()


def run_core(checkpoint: str, bundle: str, limit: float | None, device_type: str = "auto") -> str:
    """CORE of a model on a local eval bundle: the table of tasks; a run directory also gets a `core` line in its
    metrics.jsonl (at its last step), core.json and a table in report.md."""
    from tierlm.checkpoint.folders import verified_model_location
    from tierlm.data import load_tokenizer
    from tierlm.loops.evaluation import evaluate_core
    from tierlm.models import load_pretrained_model
    from tierlm.primitives import resolve_device

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
    from tierlm.builders.tasks import open_tasks
    from tierlm.checkpoint.folders import verified_model_location
    from tierlm.data import load_tokenizer
    from tierlm.models import load_pretrained_model
    from tierlm.primitives import resolve_device
    from tierlm.tasks.formats import chance_level

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
        eval_task = open_tasks(config, training=False)[1]
        n = len(eval_task) if limit is None else min(int(limit), len(eval_task))
        config.rl.eval_problems = n
        chance = sum(chance_level(eval_task.example(i)) for i in range(n)) / max(n, 1)
        accuracy = held_out_pass_at_k(config, model, tokenizer, eval_task)["pass@1"]
        results[name] = {"accuracy": accuracy, "centered": (accuracy - chance) / (1 - chance), "items": n}
    result = {"tasks": results, "core": sum(r["centered"] for r in results.values()) / max(len(results), 1)}
    record_core(location, ",".join(f"{k}={v}" for k, v in tasks.items()), result, kind="chat_core")
    return _core_table(result, "ChatCORE")


# -- the command ----------------------------------------------------------------------------
def arguments(evaluate: argparse.ArgumentParser) -> None:
    evaluate.add_argument("--checkpoint", required=True, help="a run directory, checkpoint or model folder")
    evaluate.add_argument(
        "--harness",
        type=task_list,
        default=None,
        metavar="TASKS",
        help="comma-separated lm-evaluation-harness tasks (e.g. hellaswag,arc_easy) instead of pass@k",
    )
    evaluate.add_argument(
        "--core",
        default=None,
        metavar="BUNDLE",
        help="CORE (DCLM / nanochat) of a base model from a local eval bundle folder (core.yaml, eval_data/, "
        "eval_meta_data.csv) instead of pass@k",
    )
    evaluate.add_argument(
        "--chat-core",
        type=named_sources,
        default=None,
        metavar="NAME=SOURCE,...",
        help="ChatCORE-style accuracy of a chat model: greedy pass@1 on each named task source (a folder or hub id "
        "in a GSM8K / MATH / ARC / MMLU / HumanEval / MBPP layout, or synthetic:<name>), centred on chance",
    )
    evaluate.add_argument(
        "--limit", type=positive_float, default=None, help="harness: examples per task (a fraction if < 1); core: items"
    )
    evaluate.add_argument("--num-fewshot", type=non_negative_int, default=None, help="harness: few-shot examples")
    evaluate.add_argument("--batch-size", type=positive_int, default=8, help="harness: sequences per forward pass")
    evaluate.add_argument("--include-path", default=None, help="harness: a folder of your own task YAML files")
    evaluate.add_argument(
        "--chat-template", action="store_true", help="harness: render prompts with the model's chat template"
    )
    evaluate.add_argument("--device-type", default="auto", choices=DEVICE_TYPES)
    add_config_args(
        evaluate, required=False, omitted="the config.yaml of the RL run --checkpoint is in, else the embedded defaults"
    )


def run(args: argparse.Namespace) -> None:
    """pass@k of the rl section's held-out problems, or --chat-core / --core / --harness: one of them."""
    if args.chat_core is not None:
        if args.core is not None or args.harness is not None or args.config or args.overrides:
            raise ConfigError("--chat-core names its tasks: drop --core, --harness, --config and overrides")
        print(run_chat_core(args.checkpoint, args.chat_core, args.limit, args.device_type))
    elif args.core is not None:
        if args.harness is not None or args.config or args.overrides:
            raise ConfigError(
                "--core evaluates the checkpoint on the bundle's tasks: drop --harness, --config, overrides"
            )
        print(run_core(args.checkpoint, args.core, args.limit, args.device_type))
    elif args.harness is not None:
        print(harness_table(args))
    else:
        print(pass_at_k_line(args))


def harness_table(args: argparse.Namespace) -> str:
    from tierlm.commands.harness import run_harness

    if args.config or args.overrides:
        raise ConfigError(
            "--harness evaluates the checkpoint as it is: drop --config and the overrides (they set pass@k evals)"
        )
    _, table = run_harness(
        args.checkpoint,
        args.harness,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        include_path=args.include_path,
        chat_template=args.chat_template,
        device_type=args.device_type,
    )
    return table


def pass_at_k_line(args: argparse.Namespace) -> str:
    harness_only = [
        flag
        for flag, value in (
            ("--limit", args.limit),
            ("--num-fewshot", args.num_fewshot),
            ("--include-path", args.include_path),
            ("--chat-template", args.chat_template or None),
        )
        if value is not None
    ]
    if harness_only:
        raise ConfigError(f"{', '.join(harness_only)} set the evaluation harness: add --harness TASKS")
    overrides = list(args.overrides)
    if args.device_type != "auto":  # --device-type is infra.device_type
        if "infra.device_type" in map(override_key, overrides):
            raise ConfigError("give the device once: --device-type or infra.device_type")
        overrides.append(f"infra.device_type={args.device_type}")
    own = None if args.config else rl_run_config(args.checkpoint)
    config = TierlmConfig.load(args.config or own, overrides)
    placed = {"model.model_name_or_path": "the model is --checkpoint"}
    check_overrides("eval", args.overrides, ("rl", "engine", "data"), EVAL_KEYS, placed=placed)
    result = run_eval(config, args.checkpoint)
    tools = " with the calculator" if "calculator" in config.rl.tools else ""
    settings = f"; {own}, the RL run's own settings" if own else ""
    return (
        f"pass@1 {result['pass@1']:.3f}, pass@{result['k']} {result['pass@k']:.3f} over {result['eval_problems']} "
        f"held-out problems of {config.data.dataset_name}{tools} (tool use {result['eval_tool_use']:.3f}{settings})"
    )


def rl_run_config(checkpoint: str) -> Path | None:
    """The config.yaml of the RL run that `checkpoint` (its folder, a checkpoint of it, or a model folder in either)
    belongs to — a run of a stage that trains on task rows, whose config names held-out problems — so that `tierlm
    eval` without --config scores the problems, tools and sampling the run evaluated with; None for other stages'
    runs and for folders outside a run.

    >>> rl_run_config("no/such/run") is None
    True
    """
    import json

    from tierlm.run.directory import RUN_FILE
    from tierlm.stages import STAGES

    path = Path(checkpoint)
    for run in (path, path.parent, path.parent.parent, path.parent.parent.parent):
        if (run / RUN_FILE).is_file() and (run / "config.yaml").is_file():
            try:
                stage = json.loads((run / RUN_FILE).read_text()).get("stage")
            except (OSError, ValueError, AttributeError):
                return None  # an unreadable record: the embedded defaults, as for a folder outside a run
            return run / "config.yaml" if stage in STAGES and STAGES[stage].example_kind == "task" else None
    return None


COMMAND = Command(arguments, run)
