"""The `tierlm` command line's arguments: every subcommand, its options and their types, each mistake in them one
line (argparse's usage errors, exit 2). The stage commands come from `tierlm.stages.STAGES`."""

from __future__ import annotations

import argparse

from tierlm.stages import STAGES


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported as the one line every tierlm error is (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"tierlm: error: {message} (see `{self.prog} --help`)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _named_sources(value: str) -> dict[str, str]:
    """NAME=SOURCE pairs, comma-separated."""
    pairs = [part.partition("=") for part in value.split(",") if part.strip()]
    if not pairs or any(not name.strip() or not eq or not source.strip() for name, eq, source in pairs):
        raise argparse.ArgumentTypeError(f"give NAME=SOURCE pairs separated by commas, got {value!r}")
    return {name.strip(): source.strip() for name, _, source in pairs}


def _task_list(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise argparse.ArgumentTypeError("give task names separated by commas, e.g. hellaswag,arc_easy")
    return tasks


def _temperature(text: str) -> float:
    value = _float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {text}")
    return value


def _probability(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _add_config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument(
        "--config", required=required, help="YAML config file (see configs/); omitted: the embedded defaults"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="overrides, e.g. training.learning_rate=3e-4"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tierlm", description="Train language models: tokenizer, pretrain, SFT, DPO, RL.")
    commands = parser.add_subparsers(dest="command", required=True)
    for stage in STAGES.values():
        stage_parser = commands.add_parser(stage.name, help=stage.about, description=stage.about)
        _add_config_args(stage_parser, required=False)
        stage_parser.add_argument(
            "--resume", action="store_true", help="continue from the latest checkpoint (training.resume=auto)"
        )
        stage_parser.add_argument(
            "--resume-from",
            metavar="CHECKPOINT",
            default=None,
            help="continue from this checkpoint folder, this run's or another's of the same config "
            "(training.resume_from_checkpoint)",
        )
        if stage.name == "rl":
            stage_parser.add_argument(
                "--check-parity",
                action="store_true",
                help="sample step 0's rollouts, score them with the trainer, and refuse when their log-probs differ "
                "by more than rl.parity_tolerance; trains and writes nothing",
            )

    launch = commands.add_parser(
        "launch",
        help="write a cluster launch file for a run (a Slurm script, or a TorchX component)",
    )
    scheduler = launch.add_mutually_exclusive_group(required=True)
    scheduler.add_argument("--slurm", action="store_true", help="an sbatch script")
    scheduler.add_argument(
        "--torchx", action="store_true", help="a TorchX component (Kubernetes and the other schedulers TorchX supports)"
    )
    launch.add_argument("stage", choices=sorted(STAGES), help="the stage to run")
    _add_config_args(launch, required=False)
    launch.add_argument("--nodes", type=_positive_int, required=True, help="machines")
    launch.add_argument("--gpus-per-node", type=_non_negative_int, default=0, help="ranks a machine (0: one CPU rank)")
    launch.add_argument("--time", default=None, help="Slurm: the job's time limit: MINUTES, HH:MM:SS or D-HH:MM:SS")
    launch.add_argument("--partition", default=None)
    launch.add_argument("--account", default=None)
    launch.add_argument("--cpus-per-task", type=_positive_int, default=None, help="CPU cores per node")
    launch.add_argument("--max-restarts", type=_non_negative_int, default=3, help="torchrun restarts after a rank dies")
    launch.add_argument("--port", type=int, default=29500, help="the rendezvous port on the first node")
    launch.add_argument("--python", default="python", help="the Python on the nodes (a venv's, on shared storage)")
    launch.add_argument("--out", default=None, help="write the script here (default: print it)")

    plan = commands.add_parser(
        "plan", help="print what a run would do (model, tokens, batch, optimizer groups, time) without training"
    )
    plan.add_argument("--stage", choices=list(STAGES), default="pretrain")
    _add_config_args(plan, required=False)
    plan.add_argument(
        "--world-size", type=_positive_int, default=None, help="ranks the run will have (default: $WORLD_SIZE or 1)"
    )
    plan.add_argument(
        "--layouts",
        action="store_true",
        help="also the per-rank memory of every tensor x pipeline x data-parallel split of --world-size ranks",
    )
    plan.add_argument(
        "--vocab-size",
        type=_positive_int,
        default=None,
        help="size a model from scratch for this vocabulary instead of training the run's tokenizer here",
    )
    speed = plan.add_mutually_exclusive_group()
    speed.add_argument(
        "--tokens-per-sec", type=_positive_float, default=None, help="estimate the time at this training speed"
    )
    speed.add_argument(
        "--measure", action="store_true", help="time a few training steps of the model here to estimate the time"
    )

    ablate = commands.add_parser(
        "ablate", help="run variants x seeds of one config at equal tokens; results, summary.md, plots"
    )
    _add_config_args(ablate, required=False)
    ablate.add_argument(
        "--variants", default=None, help="comma-separated V-steps, e.g. V0,V1,V3 (the first is the baseline)"
    )
    ablate.add_argument(
        "--variant", action="append", default=[], help="name:section.key=value[,section.key=value] (repeatable)"
    )
    ablate.add_argument(
        "--seeds", default=None, help="comma-separated seeds, one replicate each (default: the config's, or 0)"
    )
    ablate.add_argument("--out", default=None, help="ablation folder (default runs/ablate_<config name>)")
    ablate.add_argument(
        "--stage", choices=[name for name, stage in STAGES.items() if stage.token_rows], default="pretrain"
    )
    ablate.add_argument(
        "--report", default=None, metavar="DIR", help="only rebuild results.json, summary.md and plots of DIR"
    )

    speedrun = commands.add_parser(
        "speedrun", help="tokenizer -> pretrain (sized from --depth) -> SFT -> RL -> report card"
    )
    speedrun.add_argument(
        "--depth",
        type=_positive_int,
        default=None,
        help="model depth; everything else follows (default 4: ~10 min on 2 CPU cores)",
    )
    speedrun.add_argument(
        "--out", default=None, help="folder for the four runs and report.md (default runs/speedrun_d<depth>)"
    )
    speedrun.add_argument(
        "--pretrain-data", default=None, help="pretraining data instead of the embedded arithmetic text"
    )
    speedrun.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="applied to every stage, e.g. infra.device_type=cuda"
    )

    export = commands.add_parser("export", help="write a checkpoint as a transformers model folder")
    export.add_argument("checkpoint", help="a checkpoint, run directory or model folder")
    export.add_argument("out_dir", help="new folder for the model (weights, config, tokenizer)")
    export.add_argument(
        "--adapter-only", action="store_true", help="a LoRA run: write only the adapter, in PEFT's format"
    )
    average = commands.add_parser("average", help="average the weights of several checkpoints")
    average.add_argument("checkpoints", nargs="+", help="checkpoints or model folders of the same model")
    average.add_argument("--out", required=True, help="new folder for the averaged model")

    push = commands.add_parser(
        "push", help="upload a run's model to the Hugging Face Hub with a model card from the run"
    )
    push.add_argument("run", help="a run directory, checkpoint or model folder")
    push.add_argument("--repo", required=True, help="ORG/NAME on the Hub")
    push.add_argument("--private", action="store_true")
    push.add_argument("--dry-run", action="store_true", help="print the files and the model card; send nothing")
    report = commands.add_parser("report", help="rebuild a run's report.md and plots, or overlay several runs' curves")
    report.add_argument("run_dirs", nargs="+", help="run directories (their metrics.jsonl)")
    report.add_argument("--out", default=None, help="with several runs: the folder for the overlaid report (required)")

    evaluate = commands.add_parser(
        "eval",
        help="pass@1 / pass@k of a chat model on held-out problems (the rl section's settings), "
        "or lm-evaluation-harness tasks (--harness)",
    )
    evaluate.add_argument("--checkpoint", required=True, help="a run directory, checkpoint or model folder")
    evaluate.add_argument(
        "--harness",
        type=_task_list,
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
        type=_named_sources,
        default=None,
        metavar="NAME=SOURCE,...",
        help="ChatCORE-style accuracy of a chat model: greedy pass@1 on each named task source (a folder or hub id "
        "in a GSM8K / MATH / ARC / MMLU / HumanEval / MBPP layout, or synthetic:<name>), centred on chance",
    )
    evaluate.add_argument(
        "--limit",
        type=_positive_float,
        default=None,
        help="harness: examples per task (a fraction if < 1); core: items",
    )
    evaluate.add_argument("--num-fewshot", type=_non_negative_int, default=None, help="harness: few-shot examples")
    evaluate.add_argument("--batch-size", type=_positive_int, default=8, help="harness: sequences per forward pass")
    evaluate.add_argument("--include-path", default=None, help="harness: a folder of your own task YAML files")
    evaluate.add_argument(
        "--chat-template", action="store_true", help="harness: render prompts with the model's chat template"
    )
    evaluate.add_argument("--device-type", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    _add_config_args(evaluate, required=False)

    chat = commands.add_parser(
        "chat", help="a multi-turn chat with a trained chat model in the terminal (streamed, with the calculator)"
    )
    chat.add_argument("--checkpoint", required=True, help="a run directory, checkpoint or model folder")
    chat.add_argument("--temperature", type=_temperature, default=0.7, help="0 is greedy (/temperature T changes it)")
    chat.add_argument("--max-new-tokens", type=_positive_int, default=128)
    chat.add_argument("--device-type", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible /v1/chat/completions and a chat page for a trained chat model"
    )
    serve.add_argument("--checkpoint", required=True, help="a run directory, checkpoint or model folder")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device-type", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    serve.add_argument(
        "--engine",
        default="native",
        choices=["native", "vllm"],
        help="what generates: tierlm's engine (streams token by token), or vLLM (as rl.engine=vllm: in this process "
        "from .venv-vllm, or the server at --vllm-url; a reply arrives whole)",
    )
    serve.add_argument("--vllm-url", default=None, help="--engine vllm: a vLLM server (scripts/vllm_server.sh)")
    serve.add_argument(
        "--max-batch",
        type=_positive_int,
        default=8,
        help="replies generated together (continuous batching on tierlm's engine, native GPT; 1: one at a time)",
    )
    serve.add_argument("--max-queue", type=int, default=16, help="requests that may wait; one more is answered 429")
    serve.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take, waiting included")
    serve.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 (default: $TIERLM_API_KEY, or none)"
    )

    sample = commands.add_parser("sample", help="generate from a trained model")
    sample.add_argument("--checkpoint", required=True, help="a run directory, checkpoint or model folder, or a hub id")
    sample.add_argument("--prompt", required=True, help="the prompt (a user message for chat models)")
    sample.add_argument("--max-new-tokens", type=_positive_int, default=64)
    sample.add_argument("--temperature", type=_temperature, default=0.0, help="0 is greedy")
    sample.add_argument("--top-k", type=_positive_int, default=None)
    sample.add_argument("--top-p", type=_probability, default=None)
    sample.add_argument("--seed", type=int, default=0)
    mode = sample.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None, help="render the prompt as a user turn")
    mode.add_argument("--raw", dest="chat", action="store_false", help="continue the prompt as plain text")
    sample.add_argument("--device-type", default="auto", choices=["auto", "cpu", "cuda", "mps"])

    tokenizer = commands.add_parser("tokenizer", help="tokenizer tools").add_subparsers(
        dest="tokenizer_command", required=True
    )
    train = tokenizer.add_parser("train", help="train a byte-level BPE or character tokenizer")
    train.add_argument(
        "--data", required=True, action="append", help="text/JSONL file, folder or synthetic:<task> (repeatable)"
    )
    train.add_argument("--out", required=True, help="folder to save the tokenizer to")
    train.add_argument("--kind", choices=["bpe", "char"], default="bpe")
    train.add_argument("--vocab-size", type=_positive_int, default=512)
    train.add_argument(
        "--num-docs",
        type=_positive_int,
        default=20000,
        help="documents read from each source (generated, for synthetic tasks)",
    )

    config = commands.add_parser("config", help="config tools").add_subparsers(dest="config_command", required=True)
    _add_config_args(config.add_parser("show", help="print the resolved config"), required=False)
    config.add_parser("list", help="list the presets shipped with tierlm (use one as --config NAME)")
    return parser
