r"""The `tierlm` command line.

    tierlm pretrain --config configs/tiny_pretrain.yaml [section.key=value ...]
    tierlm sft --config configs/tiny_sft.yaml [section.key=value ...]
    tierlm rl --config configs/tiny_rl.yaml [section.key=value ...]
    tierlm dpo --config configs/tiny_dpo.yaml [section.key=value ...]
    tierlm rm --config configs/tiny_rm.yaml [section.key=value ...]
    tierlm sample --checkpoint runs/tiny_sft --prompt "What is 12 + 7?"
    tierlm eval --checkpoint runs/tiny_rl --config configs/tiny_rl.yaml
    tierlm tokenizer train --data FILE_OR_SYNTHETIC --out DIR [--kind bpe|char] [--vocab-size N]
    tierlm config show [--config FILE_OR_PRESET] [section.key=value ...]
    tierlm config list
    tierlm ablate --config PRESET [--variants V0,V1] [--variant name:key=value,...] [--seeds 0,1,2] \
        [--out DIR] [overrides]
    tierlm ablate --report DIR
    tierlm speedrun [--depth D] [--out DIR] [--pretrain-data NAME] [section.key=value ...]
    tierlm plan --config FILE_OR_PRESET [--stage pretrain] [--world-size N] [--tokens-per-sec N | --measure] \
        [section.key=value ...]
    tierlm export CHECKPOINT OUT_DIR [--adapter-only]
    tierlm average CHECKPOINT CHECKPOINT [...] --out DIR

A problem with the input (config, data, checkpoint, arguments) prints one line and exits with 2. The arguments
are `tierlm.commands.arguments`; each `cmd_*` here runs one command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tierlm.commands.arguments import build_parser
from tierlm.commands.overrides import EVAL_KEYS, check_overrides, check_stage_overrides, override_key
from tierlm.errors import ConfigError, TierlmError
from tierlm.loops.signals import RunInterrupted
from tierlm.stages import STAGES, run_stage


def cmd_train(args: argparse.Namespace) -> None:
    from tierlm.config import TierlmConfig
    from tierlm.config.launchers import accelerate_overrides

    overrides = list(args.overrides) + (["training.resume=auto"] if args.resume else [])
    if getattr(args, "resume_from", None):
        overrides.append(f"training.resume_from_checkpoint={args.resume_from}")
    config = accelerate_overrides(
        TierlmConfig.load(args.config, overrides), os.environ
    )  # under `accelerate launch`: its settings
    check_stage_overrides(args.command, STAGES[args.command], config, args.overrides)
    summary = run_stage(config, args.command, preflight=getattr(args, "check_parity", False))
    if os.environ.get("RANK", "0") != "0":
        return  # rank 0 reports for the job
    if "parity" in summary:
        p = summary["parity"]
        print(
            f"parity ok: the sampler's log-probs are {p['mean_abs_gap']:.3g} per token from the trainer's (largest "
            f"{p['max_abs_gap']:.3g}, {p['beyond_cap']:.1%} of ratios beyond rl.importance_cap, {p['tokens']} tokens)"
        )
        return
    print(f"run directory: {summary['output_dir']}")
    if "pass@1" in summary:
        start = f"{summary['initial_pass@1']:.3f} -> " if summary.get("initial_pass@1") is not None else ""
        print(
            f"held-out pass@1 {start}{summary['pass@1']:.3f}, pass@{summary['k']} {summary['pass@k']:.3f} "
            f"({summary['eval_problems']} problems)"
        )
    if "pref_acc" in summary:
        print(
            f"held-out preference accuracy {summary['policy_pref_acc']:.3f} (implicit reward: "
            f"{summary['pref_acc']:.3f})"
        )
    if "val_loss" in summary:
        bpb = f" (bits per byte {summary['val_bpb']:.4f})" if "val_bpb" in summary else ""
        print(f"final val loss: {summary['val_loss']:.4f}{bpb}")
        if "val_protocol" in summary:
            print(f"  scored: {summary['val_protocol']}")
    print(f"model: {summary['model_dir']}  ({summary['step']} steps, {summary['elapsed_s']:.0f} s)")


def cmd_plan(args: argparse.Namespace) -> None:
    from tierlm.builders.tokenizer import pretrained_location
    from tierlm.config import TierlmConfig
    from tierlm.plan import plan_run
    from tierlm.plan.scaling import measure_tokens_per_sec

    config = TierlmConfig.load(args.config, args.overrides)
    check_stage_overrides("plan", STAGES[args.stage], config, args.overrides)
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    resolved, plan, model = plan_run(config, STAGES[args.stage], world_size, args.vocab_size)
    speed = args.tokens_per_sec
    if args.measure:  # one process measured; the ranks of a data-parallel run add up
        speed = measure_tokens_per_sec(resolved, model.config.vocab_size, pretrained_location(config)) * world_size
    print(plan.table(speed))
    print(plan.memory.table())
    if args.layouts:
        from tierlm.models import unwrap_model
        from tierlm.plan.memory.layouts import ModelShape, layouts_table

        tr, infra = resolved.training, resolved.infra
        budget = infra.max_memory_gb * 1e9 if infra.max_memory_gb else None
        print(
            layouts_table(
                ModelShape.of(unwrap_model(model)),
                world_size,
                tr.per_device_train_batch_size,
                resolved.data.max_seq_length,
                budget,
                compute_bytes=2 if tr.bf16 or tr.fp16 else 4,
                activation_checkpointing=infra.activation_checkpointing,
                fused_cross_entropy=tr.fused_cross_entropy,
                vocab_parallel=infra.vocab_parallel,
                sequence_parallel=infra.sequence_parallel,
            )
        )


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise TierlmError(f"{what} must be comma-separated whole numbers, got {text!r}") from None


def cmd_ablate(args: argparse.Namespace) -> None:
    from tierlm.commands.ablate import AblationCoordinator, parse_variant, write_results
    from tierlm.config import TierlmConfig

    if args.report:
        write_results(Path(args.report))
        print(f"summary: {Path(args.report) / 'summary.md'}")
        return
    if not args.config:
        raise TierlmError("tierlm ablate needs --config (a YAML file or a preset), or --report DIR")
    base = TierlmConfig.load(args.config, args.overrides)
    given = {override_key(o) for o in args.overrides}
    for key, flag, value in (
        ("ablation.variants", "--variants", args.variants or args.variant),
        ("ablation.seeds", "--seeds", args.seeds),
    ):
        if key in given and value:
            raise ConfigError(f"{key} and its flag ({flag}) both given: keep one")
    specs = [v for v in (args.variants or "").split(",") if v.strip()] + args.variant or base.ablation.variants
    seeds = _int_list(args.seeds, "--seeds") if args.seeds else base.ablation.seeds
    coordinator = AblationCoordinator(
        args.config, [parse_variant(v) for v in specs], seeds, list(args.overrides), args.out, args.stage
    )
    results = coordinator.run()
    print(f"summary: {coordinator.out / 'summary.md'}")
    coordinator.failures(results)  # an ablation with failed runs exits 1, the first failure its last line


def cmd_speedrun(args: argparse.Namespace) -> None:
    from tierlm.commands.speedrun import DEFAULT_DEPTH, run_speedrun

    depth = args.depth or DEFAULT_DEPTH
    report = run_speedrun(depth, Path(args.out or f"runs/speedrun_d{depth}"), args.overrides, args.pretrain_data)
    print(f"report card: {report}")


def cmd_eval(args: argparse.Namespace) -> None:
    from tierlm.commands.evaluate import run_eval
    from tierlm.config import TierlmConfig

    if args.chat_core is not None:
        if args.core is not None or args.harness is not None or args.config or args.overrides:
            raise ConfigError("--chat-core names its tasks: drop --core, --harness, --config and overrides")
        from tierlm.commands.evaluate import run_chat_core

        print(run_chat_core(args.checkpoint, args.chat_core, args.limit, args.device_type))
        return
    if args.core is not None:
        if args.harness is not None or args.config or args.overrides:
            raise ConfigError(
                "--core evaluates the checkpoint on the bundle's tasks: drop --harness, --config, overrides"
            )
        from tierlm.commands.evaluate import run_core

        print(run_core(args.checkpoint, args.core, args.limit, args.device_type))
        return
    if args.harness is not None:
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
        print(table)
        return
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
    config = TierlmConfig.load(args.config, overrides)
    check_overrides(
        "eval",
        args.overrides,
        ("rl", "data"),
        EVAL_KEYS,
        placed={"model.model_name_or_path": "the model is --checkpoint"},
    )
    result = run_eval(config, args.checkpoint)
    tools = " with the calculator" if "calculator" in config.rl.tools else ""
    print(
        f"pass@1 {result['pass@1']:.3f}, pass@{result['k']} {result['pass@k']:.3f} over {result['eval_problems']} "
        f"held-out problems"
        f"{tools} (tool use {result['eval_tool_use']:.3f})"
    )


def cmd_sample(args: argparse.Namespace) -> None:
    import torch

    from tierlm.checkpoint.folders import verified_model_location
    from tierlm.checkpoint.verify import MODEL_META_FILE
    from tierlm.data import load_tokenizer
    from tierlm.models import family_of, load_pretrained_model
    from tierlm.primitives import resolve_device
    from tierlm.rollout.engine import Engine, encoder_prompt_tokens, prompt_tokens, readable_text
    from tierlm.rollout.tools import Calculator
    from tierlm.special_tokens import TOOL_CALL_START

    location = verified_model_location(args.checkpoint)
    tokenizer = load_tokenizer(location)
    model = load_pretrained_model(location, device=resolve_device(args.device_type))
    meta_file = Path(location) / MODEL_META_FILE
    try:
        stage = json.loads(meta_file.read_text()).get("stage") if meta_file.is_file() else None
    except (OSError, ValueError, AttributeError) as e:
        raise TierlmError(f"{meta_file} is not readable JSON ({e}); restore it or delete it") from None
    chat = (
        args.chat if args.chat is not None else (stage in STAGES and STAGES[stage].chat and tokenizer.has_chat_template)
    )
    if family_of(model).seq2seq:  # the prompt goes to the encoder
        chat, prompt_ids = False, encoder_prompt_tokens(tokenizer, args.prompt)
    else:
        prompt_ids = prompt_tokens(tokenizer, args.prompt, chat)
    tools = [Calculator()] if chat and TOOL_CALL_START in tokenizer.hf.get_vocab() else []
    engine = Engine(model, tokenizer.stop_ids, tokenizer, tools)
    generator = torch.Generator(device=engine.device).manual_seed(args.seed)
    completion = engine.generate(
        prompt_ids, 1, args.max_new_tokens, args.temperature, args.top_k, args.top_p, generator
    )[0]
    print(readable_text(tokenizer, completion.tokens))


def cmd_tokenizer_train(args: argparse.Namespace) -> None:
    from tierlm.checkpoint.folders import check_new_folder, publish_tokenizer
    from tierlm.data import SourceOptions, open_examples, train_bpe_tokenizer, train_char_tokenizer

    check_new_folder(
        Path(args.out), [Path(spec) for spec in args.data if not spec.startswith(("synthetic:", "builtin:"))]
    )
    texts = []
    for spec in args.data:  # the first --num-docs documents of each source, never a whole corpus
        examples = open_examples(spec, SourceOptions(synthetic_count=args.num_docs))
        texts += examples.fetch(range(min(len(examples), args.num_docs)))
    tokenizer = train_char_tokenizer(texts) if args.kind == "char" else train_bpe_tokenizer(texts, args.vocab_size)
    out = publish_tokenizer(tokenizer, Path(args.out))
    print(f"{args.kind} tokenizer with {tokenizer.vocab_size} tokens saved to {out}")


def cmd_export(args: argparse.Namespace) -> None:
    from tierlm.checkpoint import export_checkpoint
    from tierlm.models import family_for_folder, is_native_folder

    out = export_checkpoint(args.checkpoint, args.out_dir, adapter_only=args.adapter_only)
    if args.adapter_only:
        print(f"exported the LoRA adapter to {out} (peft.PeftModel.from_pretrained(base_model, {str(out)!r}))")
    elif is_native_folder(out) and not (out / "config.json").is_file():
        print(
            f"exported to {out}: a tierlm model folder (transformers has no class for this "
            f"{family_for_folder(out).name} model; "
            "tierlm loads it)"
        )
    else:
        print(f"exported to {out}")


def cmd_average(args: argparse.Namespace) -> None:
    from tierlm.checkpoint import average_checkpoints

    print(f"averaged {len(args.checkpoints)} checkpoints into {average_checkpoints(args.checkpoints, args.out)}")


def cmd_chat(args: argparse.Namespace) -> None:
    from tierlm.commands.chat import Chatbot, terminal_chat

    terminal_chat(Chatbot(args.checkpoint, args.device_type), args.temperature, args.max_new_tokens)


def cmd_serve(args: argparse.Namespace) -> None:
    from tierlm.commands.chat import Chatbot
    from tierlm.commands.serve import check_port, check_serving, serve

    api_key = args.api_key if args.api_key is not None else os.environ.get("TIERLM_API_KEY")
    check_port(args.port)  # before the model loads
    check_serving(args.host, args.max_queue, args.timeout, api_key)
    bot = Chatbot(
        args.checkpoint, args.device_type, engine=args.engine, vllm_url=args.vllm_url, batch_rows=args.max_batch
    )
    try:
        serve(bot, args.host, args.port, args.max_queue, args.timeout, api_key)
    finally:
        bot.close()


def cmd_push(args: argparse.Namespace) -> None:
    from tierlm.commands.push import push

    print(push(args.run, args.repo, private=args.private, dry_run=args.dry_run))


def cmd_report(args: argparse.Namespace) -> None:
    from tierlm.metrics.report import overlay_report, write_run_report

    if len(args.run_dirs) == 1 and args.out is None:
        print(f"wrote {write_run_report(Path(args.run_dirs[0]))}")
        return
    if args.out is None:
        raise ConfigError("several runs overlay into a new folder: give --out DIR")
    print(f"wrote {overlay_report([Path(d) for d in args.run_dirs], Path(args.out))}")


def cmd_launch(args: argparse.Namespace) -> None:
    from tierlm.commands.launch import slurm_script, torchx_component
    from tierlm.config import TierlmConfig

    config = TierlmConfig.load(args.config, args.overrides)  # a bad config is refused here, not on the cluster
    shape = dict(nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task)
    shape.update(max_restarts=args.max_restarts, port=args.port)
    if args.torchx:
        if args.time or args.partition or args.account:
            raise ConfigError("--time, --partition and --account are Slurm's: the TorchX scheduler takes its own")
        script = torchx_component(args.stage, args.config, args.overrides, config, **shape)
    else:
        if args.time is None:
            raise ConfigError("tierlm launch --slurm needs --time (the job's limit: MINUTES, HH:MM:SS or D-HH:MM:SS)")
        script = slurm_script(
            args.stage,
            args.config,
            args.overrides,
            config,
            time_limit=args.time,
            partition=args.partition,
            account=args.account,
            python=args.python,
            **shape,
        )
    if not config.training.save_steps:
        _say(
            "tierlm: warning: training.save_steps=0 saves only at the end: a restarted or requeued job starts over; "
            "set training.save_steps"
        )
    if args.out is None:
        print(script, end="")
        return
    out = Path(args.out)
    if out.exists():
        raise ConfigError(f"--out {out} exists; choose another file (nothing is overwritten)")
    out.write_text(script)
    out.chmod(0o755)
    how = f"torchx run -s <scheduler> {out}:train" if args.torchx else f"sbatch {out}"
    print(f"wrote {out}: submit it with `{how}`")


def cmd_config(args: argparse.Namespace) -> None:
    from tierlm.config import TierlmConfig
    from tierlm.config.files import list_presets

    if args.config_command == "list":
        presets = list_presets()
        width = max(map(len, presets))
        for name, about in presets.items():
            print(f"{name:<{width}}  {about}")
        return
    print(TierlmConfig.load(args.config, args.overrides).to_yaml(), end="")


def _rank_prefix() -> str:
    """ "[rank N] " inside a multi-rank torchrun job, so an error says which rank raised it."""
    return (
        f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ else ""
    )


def _say(line: str) -> None:
    """One line to stderr in one write, so the lines of several ranks sharing it never interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    # Loading a local folder needs no download bars; errors stay one line. (HF_HUB_DISABLE_PROGRESS_BARS=0 brings them
    # back.)
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") == "1" and "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides += extra  # overrides after an option (`--variants V0 training.seed=1`) are overrides too
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handlers = {
        **dict.fromkeys(STAGES, cmd_train),
        "eval": cmd_eval,
        "sample": cmd_sample,
        "export": cmd_export,
        "average": cmd_average,
        "plan": cmd_plan,
        "report": cmd_report,
        "chat": cmd_chat,
        "serve": cmd_serve,
        "push": cmd_push,
        "speedrun": cmd_speedrun,
        "ablate": cmd_ablate,
        "launch": cmd_launch,
    }
    handler = handlers.get(args.command) or {"tokenizer": cmd_tokenizer_train, "config": cmd_config}[args.command]
    try:
        handler(args)
    except TierlmError as e:
        _say(f"tierlm: error: {_rank_prefix()}{e}")
        return getattr(e, "exit_code", 2)  # 2: bad input; 1: runs that failed (an ablation's)
    except RunInterrupted as stop:
        _say(f"tierlm: {_rank_prefix()}{stop}")
        return stop.exit_code
    except KeyboardInterrupt:
        print("tierlm: interrupted; the latest checkpoint is intact", file=sys.stderr)
        return 130
    return 0
