"""New folders made from checkpoints — `export`, `average` — and the one check every command that
reads a model folder makes first (`verified_model_folder`).

An output folder must be new (or empty) and lie outside every input; it is written into a hidden
staging folder and renamed into place, so it appears only once complete.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from pathlib import Path

from safetensors import SafetensorError

from tierlm.checkpoint.core import CHECKPOINTS_DIRNAME, DEEPSPEED_DIRNAME, STATE_DIRNAME, _fsync_dir, _fsync_tree
from tierlm.checkpoint.load import (
    find_latest_checkpoint,
    is_sharded_checkpoint,
    load_sharded_state,
    resolve_model_folder,
    resolve_model_location,
)
from tierlm.checkpoint.verify import (
    META_FILE,
    MODEL_META_FILE,
    check_file_formats,
    verify_checkpoint,
    verify_model_folder,
)
from tierlm.errors import CheckpointError, first_line
from tierlm.models.io import WEIGHTS_FILE, save_model_folder
from tierlm.models.lora import ADAPTER_DIR, ADAPTER_MARK, adapter_apart, mark_adapter, saved_adapter


def verified_model_location(name: str) -> Path | str:
    """`resolve_model_location`, then a local folder verified (`verified_model_folder`); a hub id as it is."""
    location = resolve_model_location(name)
    return verified_model_folder(location) if isinstance(location, Path) else location


def verified_model_folder(name: str | Path) -> Path:
    """A local run, checkpoint or model folder resolved to its model folder (as `resolve_model_folder`),
    after checking what tierlm recorded about it: the checkpoint's sizes, hashes and links, or a
    final model folder's manifest in its training_meta.json."""
    folder = resolve_model_folder(name)
    checkpoint = folder.parent if (folder.parent / META_FILE).is_file() and folder.name == "model" else None
    problem = verify_checkpoint(checkpoint) if checkpoint is not None else verify_model_folder(folder)
    problem = problem or check_file_formats(folder)
    if problem is not None:
        raise CheckpointError(f"{checkpoint or folder} is damaged: {problem}")
    return folder


def check_new_folder(out: Path, inputs: list[Path]) -> None:
    """A new output folder: refuse one that exists with files in it, or one inside (or holding) an input."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is a file; choose a new folder")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; choose a new folder")
    target = out.resolve()
    for source in inputs:
        source = source.resolve()
        if target == source or source in target.parents or target in source.parents:
            raise CheckpointError(f"{out} overlaps the input {source}; write to a folder outside every input")


def publish_folder(tmp: Path, out: Path) -> Path:
    """Move a finished temporary folder into place (an existing empty `out` is replaced)."""
    _fsync_tree(tmp)
    if out.is_dir():
        out.rmdir()
    os.replace(tmp, out)
    _fsync_dir(out.parent)
    return out


def staging_folder(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def publish_tokenizer(tokenizer, out: Path) -> Path:
    """Save `tokenizer` into the new folder `out`, which appears only once complete."""
    tmp = staging_folder(out)
    try:
        return publish_folder(tokenizer.save(tmp), out)
    except OSError as e:
        raise CheckpointError(f"could not write {out}: {e.strerror or e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def average_checkpoints(paths: list[str | Path], out_dir: str | Path) -> Path:
    """Average the model weights of several checkpoints (or model folders) into a new model folder.

    Tokenizer, config and the native description are taken from the last one; every weight must
    have the same name and shape in all of them. Each input is verified first; a sharded checkpoint (a torchrun
    job's, DeepSpeed's) is gathered in this process first. `out_dir` must be new (or empty) and outside every
    input, and appears only once complete.
    """
    if len(paths) < 2:
        raise CheckpointError(f"averaging needs at least 2 checkpoints, got {len(paths)}")
    with tempfile.TemporaryDirectory(prefix="tierlm-average-") as scratch:
        folders = []
        for i, path in enumerate(map(Path, paths)):
            if is_sharded_checkpoint(path):
                folders.append(export_sharded_checkpoint(path, Path(scratch) / str(i)))
            else:
                folders.append(verified_model_folder(path))
        out = Path(out_dir)
        check_new_folder(out, [Path(p) for p in paths] + folders)
        return _average(folders, out)


def _average(folders: list[Path], out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    states = []
    for folder in folders:
        try:
            states.append(load_file(folder / WEIGHTS_FILE))
        except (OSError, RuntimeError, SafetensorError) as e:
            raise CheckpointError(f"cannot read {folder / WEIGHTS_FILE}: {first_line(e)}") from e
    keys = states[0].keys()
    for folder, state in zip(folders[1:], states[1:]):
        if state.keys() != keys or any(state[k].shape != states[0][k].shape for k in keys):
            raise CheckpointError(
                f"{folder} does not have the same weights as {folders[0]}; only the same model can be averaged"
            )
    average = {k: (sum(s[k].double() for s in states) / len(states)).to(states[0][k].dtype) for k in keys}
    tmp = staging_folder(out)
    try:
        shutil.copytree(folders[-1], tmp, ignore=shutil.ignore_patterns(MODEL_META_FILE))
        save_file(
            average, tmp / WEIGHTS_FILE, metadata={"format": "pt", "averaged_from": ",".join(str(f) for f in folders)}
        )
        return publish_folder(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write {out}: {e.strerror or e}") from e


def export_checkpoint(path: str | Path, out_dir: str | Path, adapter_only: bool = False) -> Path:
    """Copy a checkpoint's model folder (weights, config, tokenizer) to `out_dir`, verified first.

    The folder loads with `transformers.AutoModelForCausalLM.from_pretrained` and
    `AutoTokenizer.from_pretrained`; a native GPT is written as the equivalent Qwen3 model. A LoRA
    model is written with its adapters merged into the weights (and adapter/ beside them); with
    `adapter_only`, `out_dir` is the adapter alone in PEFT's format (`PeftModel.from_pretrained`).
    `out_dir` must be new (or empty) and outside the input; it appears only once complete.
    """
    out, path = Path(out_dir), Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    check_new_folder(out, [path])
    sharded = next((p for p in (path, path / CHECKPOINTS_DIRNAME) if is_sharded_checkpoint(p)), None)
    if sharded is None and not (path / "model" / WEIGHTS_FILE).is_file():
        latest = find_latest_checkpoint(path / CHECKPOINTS_DIRNAME) or find_latest_checkpoint(path)
        sharded = latest if latest is not None and is_sharded_checkpoint(latest) else None
    tmp = staging_folder(out)
    full = tmp.with_name(tmp.name + ".full") if adapter_only else tmp
    try:
        if sharded is not None:
            export_sharded_checkpoint(sharded, full)
        else:
            folder = verified_model_folder(path)
            if adapter_apart(folder):  # a checkpoint's base + adapters: merge them
                from tierlm.models import load_pretrained_model

                shutil.copytree(folder, full, ignore=shutil.ignore_patterns(WEIGHTS_FILE))
                save_model_folder(load_pretrained_model(folder), full)  # loading merges: a plain model
                mark_adapter(full, merged=True)
            else:
                shutil.copytree(folder, full)
        if adapter_only:
            if saved_adapter(full) is None:
                raise CheckpointError(
                    f"{path} has no LoRA adapter (it was not trained with model.lora): export the whole model"
                )
            shutil.copytree(full / ADAPTER_DIR, tmp, ignore=shutil.ignore_patterns(ADAPTER_MARK))
        return publish_folder(tmp, out)
    except OSError as e:
        raise CheckpointError(f"could not write {out}: {e.strerror or e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(full, ignore_errors=True)


def export_sharded_checkpoint(path: Path, out: Path) -> Path:
    """Gather a sharded checkpoint's weights (one process, no job needed) into a full model folder."""
    from tierlm.models import build_model_from_folder_config

    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    try:
        model = build_model_from_folder_config(path / "model")
        if (path / DEEPSPEED_DIRNAME).is_dir():  # DeepSpeed's partitions, gathered by its zero_to_fp32
            from tierlm.checkpoint.zero import consolidated_state

            model.load_state_dict(consolidated_state(path), strict=True)
        else:
            load_sharded_state(path / STATE_DIRNAME, model)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, pickle.UnpicklingError, SafetensorError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be exported: {first_line(e)}") from e
    shutil.copytree(path / "model", out, dirs_exist_ok=True)  # config, tokenizer, training meta
    save_model_folder(model, out, merge_lora=True)
    return out
