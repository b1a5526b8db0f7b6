"""The run's model from its config: a new model of the config's family (`new_model`; on the meta device only
described, for sizing), or the trained one it continues, with LoRA / QLoRA adapters when asked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

from tierlm.config import RLConfig, TierlmConfig
from tierlm.data import Tokenizer
from tierlm.errors import ConfigError
from tierlm.models import (
    family_for_folder,
    family_named,
    family_of,
    is_native_folder,
    load_pretrained_model,
    model_max_seq_len,
)
from tierlm.models.dropout import disable_dropout
from tierlm.models.lora import apply_lora, qlora_quantization_config
from tierlm.primitives import parse_dtype
from tierlm.primitives.models import meta_device


def new_model(config: TierlmConfig, vocab_size: int, device, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A model of the config's family (`model.architecture`), initialised on `device`; on "meta" only
    described (no memory, no draw from the RNG), for sizing."""
    m = config.model
    if m.short_window is None and "S" in m.window_pattern.upper():  # nanochat: a short window is half the context
        m = m.model_copy(update={"short_window": max(1, config.data.max_seq_length // 2)})
    d = config.data
    longest = max(
        2048, d.max_seq_length, d.max_encoder_length, d.max_decoder_length
    )  # rotary tables (encoder-decoders: both lengths)
    return family_named(m.architecture).build(m, vocab_size, longest, device, dtype)


def describe_model(config: TierlmConfig, vocab_size: int, pretrained: Path | str | None) -> nn.Module | None:
    """The run's model on the meta device (shapes only), or None for a hub id not yet downloaded."""
    if pretrained is None:
        return new_model(config, vocab_size, "meta")
    if isinstance(pretrained, Path):
        with meta_device():
            return family_for_folder(pretrained).build_from_folder(pretrained)
    return None


def model_context(config: TierlmConfig, vocab_size: int, pretrained: Path | str | None) -> int | None:
    """The longest sequence the run's model takes, read from its shapes on the meta device (None: a hub id
    not downloaded yet, or a model that does not say), so data can be checked against it before anything is built."""
    model = describe_model(config, vocab_size, pretrained)
    return model_max_seq_len(model) if model is not None else None


def loads_on_rank0_only(config: TierlmConfig, pretrained, kind: str) -> bool:
    """infra.cpu_ram_efficient_loading as this run honours it: under FSDP2, from a local model folder (tierlm's or
    transformers'; Accelerate's fsdp_cpu_ram_efficient_loading): rank 0 reads the weights, the other ranks build the
    model on the meta device and take their shards (and the buffers no state dict carries) by broadcast; elsewhere
    every rank reads the weights it needs anyway."""
    if not config.infra.cpu_ram_efficient_loading or pretrained is None or kind != "fsdp":
        return False
    if not isinstance(pretrained, Path) or config.model.lora.r or config.model.load_in_4bit:
        raise ConfigError(
            "infra.cpu_ram_efficient_loading builds the other ranks' model on the meta device from a local model "
            f"folder, without LoRA or 4-bit weights; {pretrained} is not one (a hub id: `hf download` it first, and "
            "give the folder), or drop the setting"
        )
    return True


def build_model(
    config: TierlmConfig, tokenizer: Tokenizer, device: torch.device, pretrained, on_meta: bool = False
) -> torch.nn.Module:
    """The run's model: a new one, a pretrained folder's or hub id's (GPT-2's research variants made of GPT-2), with
    LoRA; `on_meta`: only its shapes, on the meta device (infra.cpu_ram_efficient_loading's other ranks)."""
    m, dtype = config.model, parse_dtype(config.model.dtype)
    if on_meta:
        with meta_device():
            return family_for_folder(pretrained).build_from_folder(pretrained, dtype=dtype)
    family = family_named(m.architecture)
    check_lora_request(config, device, pretrained)
    if m.load_in_4bit:
        return _trainable(config, load_4bit_model(config, pretrained, device))
    imported = None
    if pretrained is not None and family.native and isinstance(pretrained, Path) and not is_native_folder(pretrained):
        imported = family.import_transformers(
            pretrained, device, dtype, tokenizer.vocab_size, config.model
        )  # e.g. GPT-2 weights as tierlm's gpt2 (a research variant of it, at the identity)
    if pretrained is not None and imported is None:
        model = load_pretrained_model(pretrained, device=device, dtype=dtype, trust_remote_code=m.trust_remote_code)
    else:
        model = imported if imported is not None else new_model(config, tokenizer.vocab_size, device, dtype)
        if family.seq2seq:  # the decoder starts from what UL2DataCollator starts it from: padding
            model.config.decoder_start_token_id = model.config.pad_token_id = tokenizer.pad_id
    vocab = family_of(model).vocab_size(model)
    if tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary has {vocab}; use a matching "
            f"tokenizer"
        )
    max_len = model_max_seq_len(model)
    if max_len is not None and config.data.max_seq_length > max_len:
        raise ConfigError(f"data.max_seq_length ({config.data.max_seq_length}) exceeds the model's maximum ({max_len})")
    return _trainable(config, model)


def _trainable(config: TierlmConfig, model: torch.nn.Module) -> torch.nn.Module:
    """`model` with the adapters model.lora asks for, its dropout off where training.disable_dropout says (resolved
    by the stage: on for DPO, RM and RL)."""
    model = with_lora(config, model)
    if config.training.disable_dropout:
        disable_dropout(model)
    return model


def check_lora_request(config: TierlmConfig, device: torch.device, pretrained) -> None:
    """Refuse, in one line each, what LoRA and 4-bit loading cannot do."""
    m = config.model
    if m.lora.r and pretrained is None:
        raise ConfigError(
            "model.lora trains adapters on a trained model: set model.model_name_or_path (from scratch, train the "
            "whole model)"
        )
    if not m.load_in_4bit:
        return
    if not m.lora.r:
        raise ConfigError("model.load_in_4bit freezes 4-bit weights, which cannot train: set model.lora.r (QLoRA)")
    if device.type != "cuda":
        raise ConfigError(
            f"model.load_in_4bit needs a CUDA GPU (bitsandbytes' 4-bit kernels); this run is on {device.type}: "
            "drop model.load_in_4bit and train LoRA on full-precision weights"
        )
    if pretrained is None or is_native_folder(pretrained) or family_named(m.architecture).native:
        raise ConfigError(
            "model.load_in_4bit loads a transformers model (hub id or folder); a tierlm-native model loads in full "
            "precision"
        )


def load_4bit_model(config: TierlmConfig, pretrained, device: torch.device) -> torch.nn.Module:
    """A transformers model with NF4 weights (QLoRA), ready for adapters (norms in fp32, input grads on)."""
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("model.load_in_4bit needs bitsandbytes: pip install bitsandbytes")
    from peft import prepare_model_for_kbit_training

    from tierlm.primitives.hub import hub_access

    compute = torch.bfloat16 if config.training.bf16 else torch.float16
    with hub_access(pretrained, "model"):
        model = AutoModelForCausalLM.from_pretrained(
            str(pretrained),
            quantization_config=qlora_quantization_config(compute),
            device_map={"": device.index or 0},
            trust_remote_code=config.model.trust_remote_code,
        )
    return prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=False
    )  # tierlm's own checkpointing applies


def with_lora(config: TierlmConfig, model: torch.nn.Module) -> torch.nn.Module:
    """The model with model.lora's adapters injected (unchanged without them)."""
    lora = config.model.lora
    if not lora.r:
        return model
    return apply_lora(
        model, lora.r, lora.alpha, lora.dropout, lora.target_modules, base_model=config.model.model_name_or_path
    )


def check_same_vocabulary(location, tokenizer: Tokenizer, what: str, why: str) -> None:
    """Refuse, in one line, a model folder whose tokenizer is not the policy's (`why`: what needs them equal)."""
    from tierlm.data import load_tokenizer

    theirs, ours = load_tokenizer(location).hf.get_vocab(), tokenizer.hf.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:1]
        raise ConfigError(
            f"{what} has another vocabulary ({len(theirs)} tokens, the policy's {len(ours)}; first difference "
            f"{differ}): {why}"
        )


def load_teacher(spec: str, tokenizer: Tokenizer, device: torch.device):
    """On-policy distillation's teacher (rl.teacher): any tierlm or transformers model folder, run or hub id sharing
    the student's tokenizer, loaded once and frozen (it only scores the student's samples)."""
    from tierlm.backends.references import FrozenReference
    from tierlm.checkpoint.folders import verified_model_location
    from tierlm.models import load_pretrained_model

    location = verified_model_location(spec)
    why = "distillation compares the two models' log-probs token by token, so the teacher must share the tokenizer"
    check_same_vocabulary(location, tokenizer, f"rl.teacher {spec}", why)
    return FrozenReference(load_pretrained_model(location, device=device), device)


def load_reward_model(rl: RLConfig, tokenizer: Tokenizer, device: torch.device):
    """rl.reward_model (None when unset): a reward model folder or run directory (`tierlm rm`'s, or any transformers
    ...ForSequenceClassification with one label) sharing the policy's tokenizer, frozen, scoring rl.micro_batch_size
    rows at a time."""
    from tierlm.checkpoint.folders import verified_model_location
    from tierlm.models.reward import RewardScorer, check_reward_model_folder

    spec = rl.reward_model
    if spec is None:
        return None
    location = verified_model_location(spec)
    check_reward_model_folder(location, "rl.reward_model")
    why = "it scores the policy's token ids as they are, so it must share the policy's tokenizer"
    check_same_vocabulary(location, tokenizer, f"rl.reward_model {spec}", why)
    return RewardScorer(location, device, rl.micro_batch_size)
