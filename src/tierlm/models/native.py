"""What every family tierlm builds itself shares: its folder format.

A native model folder is what `transformers.AutoModelForCausalLM.from_pretrained` loads when the
family has a transformers twin (`config.json` and `model.safetensors` under transformers' names),
plus `tierlm_model.json` — {"family": name, **the family's config} — from which tierlm rebuilds
the native module. A family whose variant transformers cannot represent writes the same folder
without `config.json`; tierlm still loads it, and `tierlm export` says why transformers cannot.
Loading never unpickles anything.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch._guards import active_fake_mode

from tierlm.errors import ModelLoadError, first_line
from tierlm.models.kv_cache import KVCache
from tierlm.models.registry import NATIVE_CONFIG_FILE, WEIGHTS_FILE, ModelFamily, native_description
from tierlm.primitives.losses import get_labels
from tierlm.primitives.models import materialize, meta_device


class NativeFamily(ModelFamily):
    """A family with its own `nn.Module` (`model_class`) and dataclass config (`config_class`)."""

    native = True
    model_class: type[nn.Module]
    config_class: type

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, self.model_class)

    def vocab_size(self, model: nn.Module) -> int:
        return model.config.vocab_size

    def input_embedding(self, model: nn.Module) -> nn.Embedding:
        """The token table, `embed` in tierlm's own models (a family whose model names it otherwise says so)."""
        return model.embed

    def output_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def with_output_head(self, model: nn.Module, head: nn.Module) -> nn.Module:
        model.lm_head = head  # a tied head is untied: the embedding stays the token table
        if getattr(model.config, "tie_embeddings", False):  # and stays untied when the weights are re-tied after a load
            model.config = copy.copy(model.config)
            model.config.tie_embeddings = False
        return model

    def build_from_config(self, config, device="cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
        """Build on the meta device, allocate on `device`, initialise once (device "meta": described only;
        under the memory planner's FakeTensorMode: fake tensors of the right shapes and dtype)."""
        if active_fake_mode() is not None:  # FakeTensorMode cannot swap meta parameters for fake ones
            default = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.device(device):
                    model = self.model_class(config)
            finally:
                torch.set_default_dtype(default)
            model.tie_weights()
            model.init_weights()  # as the real path: some families fill buffers (rotary tables) here
            return model
        with meta_device():
            model = self.model_class(config)
        if torch.device(device).type == "meta":
            return model
        model = materialize(model, device)
        model.tie_weights()  # to_empty allocates every parameter anew; shared ones must be shared again
        model.init_weights()
        return model.to(dtype=dtype) if dtype != torch.float32 else model

    # -- names and configs on the transformers side (identity: a family without a twin) -----------
    def to_hf_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state)

    def from_hf_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state)

    def hf_config(self, config):
        """The transformers config of the same architecture, or None when there is none."""
        return None

    def import_transformers(
        self,
        folder: Path,
        device="cpu",
        dtype: torch.dtype = torch.float32,
        vocab_size: int | None = None,
        model_config=None,
    ) -> nn.Module | None:
        """A transformers folder of this family's twin as a native model (None: not supported). `vocab_size`:
        the run's tokenizer's, for a family whose import adds tokens; `model_config`: the run's model section, for a
        family that reshapes what it imports (GPT-2's research variants)."""
        return None

    def exportable(self, model: nn.Module) -> str | None:
        return (
            None
            if self.hf_config(model.config) is not None
            else f"transformers has no class for this {self.name} model"
        )

    # -- folders ---------------------------------------------------------------------------
    def save(self, model, folder, state_dict=None):
        state = state_dict if state_dict is not None else model.state_dict()
        hf_state = {k: v.detach().contiguous().cpu() for k, v in self.to_hf_state(model, state).items()}
        save_file(hf_state, Path(folder) / WEIGHTS_FILE, metadata={"format": "pt"})
        self.save_config(model, folder)

    def save_config(self, model, folder):
        folder = Path(folder)
        hf_config = self.hf_config(model.config)
        if hf_config is not None:
            hf_config.save_pretrained(folder)
        description = {"family": self.name, **dataclasses.asdict(model.config)}
        (folder / NATIVE_CONFIG_FILE).write_text(json.dumps(description, indent=2) + "\n")

    def config_from_folder(self, folder: Path):
        description = dict(native_description(folder) or {})
        description.pop("family", None)
        try:
            return self.config_class(**description)
        except TypeError as e:
            raise ModelLoadError(
                f"{Path(folder) / NATIVE_CONFIG_FILE} does not describe a {self.name} model: {e}"
            ) from None

    def after_materialize(self, model: nn.Module) -> None:
        """After `to_empty` (a model built on the meta device given storage): the ties and the derived buffers no
        state dict carries (the rotary tables), computed again."""
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        if hasattr(model, "init_rotary"):
            model.init_rotary()

    def build_from_folder(self, folder, dtype=torch.float32):
        return self.build_from_config(self.config_from_folder(Path(folder)), dtype=dtype)

    def read_state(self, model, folder):
        return self.from_hf_state(model, load_file(Path(folder) / WEIGHTS_FILE, device="cpu"))

    def load(self, folder, device="cpu", dtype=torch.float32, trust_remote_code=False):
        folder = Path(folder)
        config = self.config_from_folder(folder)
        problems = config.validate() if hasattr(config, "validate") else []
        if problems:
            raise ModelLoadError(f"{folder / NATIVE_CONFIG_FILE}: {problems[0]}")
        model = self.build_from_config(config, device=device, dtype=dtype)
        try:
            state = self.from_hf_state(model, load_file(folder / WEIGHTS_FILE, device=str(device)))
            missing, unexpected = model.load_state_dict(state, strict=False)
        except (OSError, ValueError, SafetensorError) as e:
            raise ModelLoadError(f"cannot read native model folder {folder}: {first_line(e)}") from None
        except RuntimeError as e:  # shapes that differ from the config
            detail = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else first_line(e)
            raise ModelLoadError(f"{folder / WEIGHTS_FILE} does not match its config ({detail})") from None
        if missing or unexpected:
            raise ModelLoadError(
                f"{folder / WEIGHTS_FILE} does not match its config: missing {missing}, unexpected {unexpected}"
            )
        return model


class NativeCausalLM(NativeFamily):
    """A native family whose module follows tierlm's forward: `model(input_ids, position_ids=, cache=,
    labels=, loss_weights=, logits_at=)` (logits, or the fused head + loss with labels; with `logits_at` (B,), the
    logits of that position of each row only, (B, V)), a `config` with `depth`, `num_kv_heads`, `head_dim` and
    `max_seq_len`, so it runs with the shared `KVCache`."""

    def logits(self, model, batch):
        return model(batch["input_ids"], **self.model_inputs(batch))

    def fuses_cross_entropy(self, model):
        return True

    def cross_entropy(self, model, batch, weights):
        return model(batch["input_ids"], labels=get_labels(batch), loss_weights=weights, **self.model_inputs(batch))

    def model_inputs(self, batch) -> dict:
        """What the module's forward takes from a batch beside its tokens and labels."""
        return {"position_ids": batch.get("position_ids")}

    def prefill(self, model, ids, max_len):
        cache = KVCache(model.config, ids.shape[0], max_len, ids.device, next(model.parameters()).dtype)
        last = torch.full((ids.shape[0],), ids.shape[1] - 1, device=ids.device)  # not (B, T, V) for every position
        return model(ids, cache=cache, logits_at=last), cache

    def decode(self, model, tokens, cache):
        return model(tokens[:, None], cache=cache)[:, -1]

    def repeat_cache(self, cache, n):
        cache.repeat(n)

    def max_seq_len(self, model):
        return model.config.max_seq_len
