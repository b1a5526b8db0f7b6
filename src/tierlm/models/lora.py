"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on any family,
through PEFT.

`apply_lora` injects PEFT's LoRA layers into the model in place (`peft.inject_adapter_in_model`): the
model keeps its class, so its family adapter, the fused head + loss, FSDP2, checkpointing and the
engine see the same model; the base weights are frozen and only the adapters train.

A model folder of a LoRA model holds the family's usual weights file and an `adapter/` folder in
PEFT's format (`adapter_config.json`, `adapter_model.safetensors`, keys named as in the folder's
weights, so `peft.PeftModel.from_pretrained(base, "model/adapter")` takes it). `tierlm_adapter.json`
there says whether the folder's weights already hold the update (`merged`: a run's final model,
loadable by anything as a plain model) or are the frozen base (checkpoints: resuming needs base and
adapters apart, bit for bit). Loading an unmerged folder merges on the way (`load_adapter_folder`).

peft is imported only when adapters are used; `has_lora` never imports it.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from tierlm.errors import ConfigError, ModelLoadError, first_line

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_MARK = "tierlm_adapter.json"
PEFT_PREFIX = "base_model.model."  # how PeftModel.save_pretrained names adapter tensors


def _peft():
    import logging

    # peft imports torchao when it is installed, whose import logs a warning per CUDA-only kernel it
    # cannot load on this machine and torch deprecation notes: nothing a LoRA user can act on.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora needs PEFT: pip install peft (or bash scripts/setup.sh)") from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return peft


def has_lora(model: nn.Module) -> bool:
    """Does `model` carry LoRA layers (without importing peft)?"""
    return any(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in model.modules())


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return ((n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer"))


def all_linear_targets(model: nn.Module) -> list[str]:
    """The leaf names of the linear layers inside the model's repeated blocks (PEFT matches a target
    name against the end of each module's name): attention and MLP, never the embeddings or the head.

    >>> from tierlm.models.gpt.model import GPT, GPTConfig
    >>> all_linear_targets(GPT(GPTConfig(vocab_size=64, depth=1, aspect_ratio=32, head_dim=32)))
    ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']
    """
    from tierlm.models.registry import family_of

    inside = {id(m) for block in family_of(model).blocks(model) for m in block.modules() if isinstance(m, nn.Linear)}
    leaves = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if id(m) in inside}
    clashing = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in inside
    }
    if leaves & clashing:  # a block's leaf name also names a layer outside the blocks: name them in full
        return sorted(n for n, m in model.named_modules() if id(m) in inside)
    return sorted(leaves)


def apply_lora(
    model: nn.Module,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    base_model: str | None = None,
) -> nn.Module:
    """Inject LoRA adapters (A random, B zero: the model computes what it did) and freeze everything
    else; returns the same model. `base_model` is recorded in the adapter's config (PEFT's
    base_model_name_or_path)."""
    peft = _peft()
    targets = all_linear_targets(model) if target_modules == "all-linear" else list(target_modules)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        base_model_name_or_path=base_model,
    )
    try:
        peft.inject_adapter_in_model(config, model)
    except ValueError as e:  # no module matched, or an unsupported layer type
        raise ConfigError(f"model.lora.target_modules={target_modules}: {first_line(e)}") from None
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    model._tierlm_lora_config = config  # what save_adapter writes
    return model


def tensor_parallel_plan(block: nn.Module, plan: dict[str, str], sequence_parallel: bool = False) -> dict[str, str]:
    """A block's tensor-parallel `plan` (`tierlm.primitives.model_parallel.apply_tensor_parallel`'s words) for the block
    with LoRA adapters in its linear layers: each adapted layer's frozen base splits as the plain layer did, and

    - column-wise (output split): B splits by columns with it; A stays whole (its input is the whole activation,
      and B's split input sums A's gradient over the group in backward, as it does for any column-wise input);
    - row-wise (input split): A splits by rows with it (its output summed over the group); B stays whole (its
      gradient summed over the group when the sequence is split too: each rank then holds its share of the tokens).

    A `ConfigError` for an adapted layer split any other way (GPT-2's fused q/k/v) and for adapter dropout, which
    would drop different inputs on each rank of a group."""
    out = {}
    for path, kind in plan.items():
        layer = block.get_submodule(path)
        if not (hasattr(layer, "lora_A") and hasattr(layer, "base_layer")):
            out[path] = kind
            continue
        if any(getattr(d, "p", 0.0) > 0 for d in layer.lora_dropout.values()):
            raise ConfigError(
                "model.lora.dropout under tensor parallelism would drop different inputs on each rank of a group: "
                "set model.lora.dropout=0"
            )
        a, b = f"{path}.lora_A.default", f"{path}.lora_B.default"
        if kind == "colwise":
            out.update({f"{path}.base_layer": "colwise", b: "colwise"})
        elif kind == "rowwise":
            out.update({f"{path}.base_layer": "rowwise", a: "rowwise"})
            if sequence_parallel:  # B then sees this rank's share of the tokens: its gradient is a share too
                out[b] = "grad_allreduce"
        else:
            raise ConfigError(
                f"model.lora on {path}, which tensor parallelism splits as {kind}: leave it out of "
                f"model.lora.target_modules, or train without infra.tensor_parallel_size"
            )
    return out


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run the base model: the adapters add nothing inside (DPO's reference, RL's KL reference)."""
    layers = [m for _, m in lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


# -- state -----------------------------------------------------------------------------------
def is_adapter_key(key: str) -> bool:
    return ".lora_" in key


def base_key(key: str) -> str:
    """>>> base_key("blocks.0.attn.q_proj.base_layer.weight")
    'blocks.0.attn.q_proj.weight'
    """
    return key.replace(".base_layer.", ".")


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base weights under the plain model's names, adapter tensors under the model's names)."""
    base = {base_key(k): v for k, v in state.items() if not is_adapter_key(k)}
    return base, {k: v for k, v in state.items() if is_adapter_key(k)}


def lora_scalings(model: nn.Module) -> dict[str, float]:
    """{module name: alpha / r} of each adapted layer."""
    return {name: float(layer.scaling["default"]) for name, layer in lora_layers(model)}


def merged_state(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scalings: dict[str, float]
) -> dict[str, torch.Tensor]:
    """The base weights with each adapter's update added: W + (alpha / r) B A (computed in fp32)."""
    out = dict(base)
    for module, scale in scalings.items():
        a, b = adapter[f"{module}.lora_A.default.weight"], adapter[f"{module}.lora_B.default.weight"]
        weight = base[f"{module}.weight"]
        out[f"{module}.weight"] = (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
    return out


def model_state(
    model: nn.Module, base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Base weights and adapters, named as the LoRA model's `state_dict()` names them."""
    out = {}
    for key in model.state_dict():
        source = adapter if is_adapter_key(key) else base
        name = key if is_adapter_key(key) else base_key(key)
        if name not in source:
            raise ModelLoadError(f"the saved model has no {name!r}: it was not trained with these LoRA settings")
        out[key] = source[name]
    return out


# -- folders ---------------------------------------------------------------------------------
def _module_renamer(model: nn.Module, to_folder: bool):
    """Module names as the family writes them into a folder (to_folder) or back."""
    from tierlm.models.registry import family_of

    family = family_of(model)
    rename = getattr(family, "to_hf_state" if to_folder else "from_hf_state", None)
    if rename is None:
        return lambda name: name

    def module_name(name: str) -> str:
        (key,) = rename(model, {f"{name}.weight": torch.empty(1, 1)}).keys() or (f"{name}.weight",)
        return key.removesuffix(".weight")

    return module_name


def save_adapter(model: nn.Module, folder: Path, adapter: dict[str, torch.Tensor], merged: bool) -> None:
    """Write `folder`/adapter/ in PEFT's format, named as the folder's weights are."""
    from safetensors.torch import save_file

    out = Path(folder) / ADAPTER_DIR
    out.mkdir(parents=True, exist_ok=True)
    rename, tensors = _module_renamer(model, to_folder=True), {}
    for key, value in adapter.items():
        module, _, rest = key.partition(".lora_")
        tensors[PEFT_PREFIX + rename(module) + ".lora_" + rest.replace(".default.", ".")] = (
            value.detach().contiguous().cpu()
        )
    save_file(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    save_adapter_config(model, folder, merged)


def save_adapter_config(model: nn.Module, folder: Path, merged: bool = False) -> None:
    """adapter/adapter_config.json (PEFT's) and tierlm_adapter.json; alone, for a sharded checkpoint's
    model/ (its weights, adapters included, are the shards)."""
    out = Path(folder) / ADAPTER_DIR
    out.mkdir(parents=True, exist_ok=True)
    model._tierlm_lora_config.save_pretrained(str(out))
    mark_adapter(folder, merged)


def mark_adapter(folder: Path, merged: bool) -> None:
    """Record whether `folder`'s weights hold its adapter's update."""
    (Path(folder) / ADAPTER_DIR / ADAPTER_MARK).write_text(json.dumps({"merged": merged}) + "\n")


def saved_adapter(folder: Path | str) -> dict | None:
    """{"merged": bool} when a model folder carries an adapter, else None."""
    mark = Path(folder) / ADAPTER_DIR / ADAPTER_MARK
    if not mark.is_file():
        return None
    try:
        return json.loads(mark.read_text())
    except ValueError as e:
        raise ModelLoadError(f"cannot read {mark}: {first_line(e)}") from None


def adapter_apart(folder: Path | str) -> bool:
    """Does a model folder keep a LoRA adapter apart from its weights (a checkpoint's: base + adapters)?"""
    mark = saved_adapter(folder) if Path(folder).is_dir() else None
    return mark is not None and not mark["merged"]


def inject_saved_adapter(model: nn.Module, folder: Path | str) -> nn.Module:
    """Inject the LoRA layers a model folder's adapter/ describes (its weights are not loaded)."""
    peft = _peft()
    config = peft.LoraConfig.from_pretrained(str(Path(folder) / ADAPTER_DIR))
    return apply_lora(model, config.r, config.lora_alpha, config.lora_dropout, sorted(config.target_modules))


def read_adapter(model: nn.Module, folder: Path | str) -> dict[str, torch.Tensor]:
    """A folder's adapter tensors, named as the LoRA model's `state_dict()` names them."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_DIR / ADAPTER_WEIGHTS
    try:
        saved = load_file(path, device="cpu")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {first_line(e)}") from None
    rename, out = _module_renamer(model, to_folder=False), {}
    for key, value in saved.items():
        module, _, rest = key.removeprefix(PEFT_PREFIX).partition(".lora_")
        name, _, leaf = rest.rpartition(".")
        out[f"{rename(module)}.lora_{name}.default.{leaf}"] = value
    return out


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold each adapter into its base layer and put the plain layer back (PEFT's merge_and_unload, in place)."""
    for name, layer in list(lora_layers(model)):
        layer.merge()
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer.get_base_layer())
    if hasattr(model, "_tierlm_lora_config"):
        del model._tierlm_lora_config
    return model


def load_adapter_folder(model: nn.Module, folder: Path | str) -> nn.Module:
    """A model loaded from `folder` whose adapter/ is not merged into the weights: the adapters are
    injected, loaded and merged, so the model computes what the trained LoRA model did."""
    inject_saved_adapter(model, folder)
    missing = set(k for k in model.state_dict() if is_adapter_key(k))
    adapter = read_adapter(model, folder)
    if set(adapter) != missing:
        raise ModelLoadError(f"{Path(folder) / ADAPTER_DIR} does not match its adapter_config.json")
    model.load_state_dict(adapter, strict=False)
    return merge_adapters(model)


def qlora_quantization_config(compute_dtype: torch.dtype = torch.bfloat16):
    """transformers' `BitsAndBytesConfig` for QLoRA (Dettmers et al. 2023): NF4 weights, double
    quantisation, matmuls in `compute_dtype`."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )
