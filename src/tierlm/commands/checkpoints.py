"""`tierlm export` (a checkpoint as a transformers model folder, or a LoRA run's adapter in PEFT's format) and
`tierlm average` (the weights of several checkpoints of one model)."""

from __future__ import annotations

import argparse

from tierlm.commands.options import Command


def export_arguments(export: argparse.ArgumentParser) -> None:
    export.add_argument("checkpoint", help="a checkpoint, run directory or model folder")
    export.add_argument("out_dir", help="new folder for the model (weights, config, tokenizer)")
    export.add_argument(
        "--adapter-only", action="store_true", help="a LoRA run: write only the adapter, in PEFT's format"
    )


def export(args: argparse.Namespace) -> None:
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


def average_arguments(average: argparse.ArgumentParser) -> None:
    average.add_argument("checkpoints", nargs="+", help="checkpoints or model folders of the same model")
    average.add_argument("--out", required=True, help="new folder for the averaged model")


def average(args: argparse.Namespace) -> None:
    from tierlm.checkpoint import average_checkpoints

    print(f"averaged {len(args.checkpoints)} checkpoints into {average_checkpoints(args.checkpoints, args.out)}")


EXPORT = Command(export_arguments, export)
AVERAGE = Command(average_arguments, average)
