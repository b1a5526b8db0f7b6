"""`tierlm pretrain | sft | dpo | rm | rl`: one command per row of `tierlm.stages.STAGES` (`stage_command`), each
training its stage from a config file or preset and `section.key=value` overrides, and printing what the run ended
with."""

from __future__ import annotations

import argparse
import os
from functools import partial

from tierlm.commands.options import Command, add_config_args
from tierlm.commands.overrides import check_stage_overrides

PREFLIGHTS = {
    "rl": (
        "--check-parity",
        "sample step 0's rollouts, score them with the trainer, and refuse when their log-probs differ by more than "
        "rl.parity_tolerance; trains and writes nothing",
    )
}
"""A stage -> the flag that runs its pre-flight check instead of training (`run_stage(..., preflight=True)`), and
its help."""


def arguments(parser: argparse.ArgumentParser, stage: str) -> None:
    add_config_args(parser, required=False)
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint (training.resume=auto)"
    )
    parser.add_argument(
        "--resume-from",
        metavar="CHECKPOINT",
        default=None,
        help="continue from this checkpoint folder, this run's or another's of the same config "
        "(training.resume_from_checkpoint)",
    )
    parser.set_defaults(preflight=False)
    if stage in PREFLIGHTS:
        flag, about = PREFLIGHTS[stage]
        parser.add_argument(flag, dest="preflight", action="store_true", help=about)


def run(args: argparse.Namespace) -> None:
    from tierlm.config import TierlmConfig
    from tierlm.config.launchers import accelerate_overrides
    from tierlm.stages import STAGES, run_stage

    overrides = list(args.overrides) + (["training.resume=auto"] if args.resume else [])
    if args.resume_from:
        overrides.append(f"training.resume_from_checkpoint={args.resume_from}")
    config = accelerate_overrides(TierlmConfig.load(args.config, overrides), os.environ)  # `accelerate launch`'s
    check_stage_overrides(args.command, STAGES[args.command], config, args.overrides)
    summary = run_stage(config, args.command, preflight=args.preflight)
    if os.environ.get("RANK", "0") == "0":  # rank 0 reports for the job
        print("\n".join(summary_lines(summary)))


def summary_lines(summary: dict) -> list[str]:
    """What a run ended with, as the command prints it."""
    if "parity" in summary:
        p = summary["parity"]
        routing = (
            f"; routed alike: {p['routing_token_agreement']:.1%} of tokens, {p['routing_decision_agreement']:.1%} of "
            "router decisions"
            if "routing_token_agreement" in p
            else ""
        )
        return [
            f"parity ok: the sampler's log-probs are {p['mean_abs_gap']:.3g} per token from the trainer's (largest "
            f"{p['max_abs_gap']:.3g}, {p['beyond_cap']:.1%} of ratios beyond rl.importance_cap, {p['tokens']} "
            f"tokens){routing}"
        ]
    lines = [f"run directory: {summary['output_dir']}"]
    if "pass@1" in summary:
        start = f"{summary['initial_pass@1']:.3f} -> " if summary.get("initial_pass@1") is not None else ""
        lines.append(
            f"held-out pass@1 {start}{summary['pass@1']:.3f}, pass@{summary['k']} {summary['pass@k']:.3f} "
            f"({summary['eval_problems']} problems)"
        )
    if "pref_acc" in summary:
        lines.append(
            f"held-out preference accuracy {summary['policy_pref_acc']:.3f} (implicit reward: "
            f"{summary['pref_acc']:.3f})"
        )
    if "val_loss" in summary:
        bpb = f" (bits per byte {summary['val_bpb']:.4f})" if "val_bpb" in summary else ""
        lines.append(f"final val loss: {summary['val_loss']:.4f}{bpb}")
        if "val_protocol" in summary:
            lines.append(f"  scored: {summary['val_protocol']}")
    lines.append(f"model: {summary['model_dir']}  ({summary['step']} steps, {summary['elapsed_s']:.0f} s)")
    return lines


def stage_command(name: str) -> Command:
    """`tierlm NAME` for the stage NAME of `tierlm.stages.STAGES`."""
    return Command(partial(arguments, stage=name), run)
