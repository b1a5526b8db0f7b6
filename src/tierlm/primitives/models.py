"""Tier 1: loading transformers causal LMs (hub id or local path), or building one from a config."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tierlm.errors import ModelLoadError, first_line
from tierlm.primitives.hub import HubUnreachable, hub_access


class _FromMeta(TorchFunctionMode):
    """What a model described on the meta device needs of torch, without torch's Python reference ops (a meta
    tensor's `normal_` and `empty_like` run through them; their first use imports torch._dynamo, sympy and torch's
    symbolic shapes: `tierlm sample` started 1.6-2.3 s later on 2 cores): initialisation (`torch.nn.init`'s
    functions and the in-place fills they use) is skipped, a meta tensor having no values to fill; `empty_like` of a
    contiguous meta tensor onto a device is `torch.empty` of its shape there."""

    INIT = frozenset(
        "normal_ uniform_ fill_ zero_ trunc_normal_ kaiming_uniform_ kaiming_normal_ xavier_uniform_ xavier_normal_ "
        "ones_ zeros_ constant_ orthogonal_ eye_".split()
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in self.INIT:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # nn.init passes it by name
            if getattr(tensor, "is_meta", False):
                return tensor
        if func is torch.empty_like and args and args[0].is_meta and args[0].is_contiguous() and len(kwargs) == 1:
            if (device := kwargs.get("device")) is not None and torch.device(device).type != "meta":
                return torch.empty(args[0].shape, dtype=args[0].dtype, device=device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """`torch.device("meta")` for describing a model that is allocated and initialised afterwards (`materialize`,
    then its own `init_weights`), with the modules' own initialisation at construction skipped: it would fill
    nothing, and on meta tensors it runs through torch's reference ops (`_FromMeta`).

    >>> with meta_device():
    ...     layer = nn.Linear(4, 3)
    >>> layer.weight.is_meta, tuple(layer.weight.shape)
    (True, (3, 4))
    """
    with torch.device("meta"), _FromMeta():
        yield


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model.to_empty(device=device)`: a model described on the meta device given uninitialised storage on `device`
    (then its own init, or loaded weights, fill it), without torch's reference ops (`_FromMeta`).

    >>> with meta_device():
    ...     layer = nn.Linear(4, 3)
    >>> layer = materialize(layer, "cpu")
    >>> layer.weight.device.type, tuple(layer.weight.shape), layer.weight.requires_grad
    ('cpu', (3, 4), True)
    """
    with _FromMeta():
        return model.to_empty(device=device)


def load_hf_model(
    model_name: str,
    torch_dtype: torch.dtype,
    device_map: dict[str, int] | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a transformers causal LM from a hub id or a local folder.

    Remote code stays off unless asked for. A path that does not exist, or a hub id that cannot
    be reached, is a `ModelLoadError` naming it.

    >>> import tempfile
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> folder = tempfile.mkdtemp()
    >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                      num_attention_heads=2, num_key_value_heads=1)
    >>> LlamaForCausalLM(config).save_pretrained(folder)
    >>> model = load_hf_model(folder, torch.float32, None)
    >>> type(model).__name__, next(model.parameters()).dtype
    ('LlamaForCausalLM', torch.float32)
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    if not model_name:
        raise ModelLoadError("model_name is empty: give a hub id or a local model folder")
    kwargs = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        with hub_access(model_name, "model"):  # a Hub id on a machine without the Hub: one line, no retries
            return AutoModelForCausalLM.from_pretrained(model_name, **kwargs)
    except HubUnreachable:
        raise
    except (
        OSError,
        ValueError,
        RuntimeError,
        SafetensorError,
    ) as e:  # RuntimeError: weights whose shapes differ from the config
        where = "local folder" if Path(model_name).exists() else "hub id or path"
        raise ModelLoadError(f"cannot load model {model_name!r} ({where}): {first_line(e)}") from e


def create_hf_model_from_config(
    model_type: str, torch_dtype: torch.dtype = torch.float32, **config_kwargs
) -> nn.Module:
    """A randomly initialised transformers causal LM of `model_type` (e.g. "qwen3", "llama").

    >>> model = create_hf_model_from_config("qwen3", vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> type(model).__name__
    'Qwen3ForCausalLM'
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(model_type, **config_kwargs)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"unknown transformers model_type {model_type!r}: {e}") from e
    return AutoModelForCausalLM.from_config(config, dtype=torch_dtype)


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter `model` holds under several (an embedding tied to the head), first name first.

    >>> head = nn.Linear(4, 10, bias=False); model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "head": head})
    >>> head.weight = model["embed"].weight
    >>> tied_names(model)
    [['embed.weight', 'head.weight']]
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]
