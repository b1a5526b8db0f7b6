"""Reward models: a causal LM whose vocabulary head is replaced by one score per position, read at each
sequence's last token (InstructGPT's reward model; TRL's RewardTrainer trains the same thing).

A reward model's folder is transformers' `<Architecture>ForSequenceClassification` with one label
(`score.weight` beside the backbone, `pad_token_id` set so the last non-pad token is found), which
`AutoModelForSequenceClassification` loads, and which `RewardScorer` runs as an RL reward.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tierlm.errors import ConfigError
from tierlm.models.registry import family_of

HEADS = ("ForCausalLM", "LMHeadModel")
"""How transformers names a causal LM class; its reward model swaps this for `ForSequenceClassification`."""


def classifier_architecture(causal_lm: str) -> str:
    """>>> classifier_architecture("Qwen3ForCausalLM"), classifier_architecture("GPT2LMHeadModel")
    ('Qwen3ForSequenceClassification', 'GPT2ForSequenceClassification')
    """
    for suffix in HEADS:
        if causal_lm.endswith(suffix):
            return causal_lm[: -len(suffix)] + "ForSequenceClassification"
    raise ConfigError(f"{causal_lm} is not a transformers causal LM class: a reward model needs one")


def _is_transformers(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "model_type")


def _causal_lm_name(model: nn.Module) -> str:
    """The transformers causal LM class `model` saves as (its family's twin for a native model)."""
    if _is_transformers(model):
        return type(model).__name__
    hf_config = getattr(family_of(model), "hf_config", lambda config: None)
    hf = hf_config(model.config)
    if hf is None or not getattr(hf, "architectures", None):
        raise ConfigError(
            f"a reward model is saved as a transformers sequence classifier; the {family_of(model).name} family has "
            "no transformers twin: start from a gpt or transformers model"
        )
    return hf.architectures[0]


def add_score_head(model: nn.Module, pad_id: int) -> nn.Module:
    """`model` (a causal LM, modified in place) with its vocabulary head replaced by an untied `Linear(hidden, 1)`
    (normal, std 1/sqrt(hidden)): its "logits" are then one score per position (B, T, 1).

    >>> from tierlm.models import GPTConfig, build_gpt
    >>> gpt = build_gpt(GPTConfig(depth=1, aspect_ratio=16, head_dim=16, vocab_size=10, max_seq_len=8))
    >>> rm = add_score_head(gpt, pad_id=0)
    >>> rm(torch.tensor([[1, 2, 3]])).shape, is_reward_model(rm)
    (torch.Size([1, 3, 1]), True)
    """
    name = classifier_architecture(_causal_lm_name(model))
    family = family_of(model)
    head = family.output_head(model)
    score = nn.Linear(head.in_features, 1, bias=False, device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        score.weight.normal_(std=head.in_features**-0.5)
    if _is_transformers(model):
        model.config.tie_word_embeddings = False  # saved with its own head, never re-tied to the embedding
    family.with_output_head(model, score)
    model.reward_head = {"architecture": name, "pad_token_id": int(pad_id)}
    return model


def is_reward_model(model: nn.Module) -> bool:
    return getattr(model, "reward_head", None) is not None


def classifier_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reward model's weights under its sequence classifier's names: its head `lm_head.weight` is `score.weight`."""
    assert "lm_head.weight" in state, "a reward model's weights without its head"
    out = dict(state)
    out["score.weight"] = out.pop("lm_head.weight")
    return out


def mark_classifier(model: nn.Module, folder: Path) -> None:
    """Make the config.json `save_model_folder` / `save_model_config` wrote for a reward model its sequence
    classifier's: the architecture, one label and the pad id (the weights go under `classifier_state`'s names)."""
    folder, head = Path(folder), model.reward_head
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.update(architectures=[head["architecture"]], pad_token_id=head["pad_token_id"], tie_word_embeddings=False)
    config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})  # num_labels = 1: a scalar score
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _config(folder: str | Path) -> dict | None:
    config_file = Path(folder) / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else None


def _is_classifier(config: dict | None) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in (config or {}).get("architectures") or [])


def is_reward_model_folder(folder: str | Path) -> bool:
    """A folder holding a sequence classifier (a reward model), which scores text and cannot generate."""
    return _is_classifier(_config(folder))


def check_reward_model_folder(folder: Path, what: str) -> dict:
    """config.json of a reward model folder, or a one-line refusal naming what it is instead (`what`: the setting)."""
    config = _config(folder)
    if config is None:
        raise ConfigError(f"{what}: {folder} has no config.json; give a reward model folder (tierlm rm writes one)")
    labels = len(config.get("id2label") or {"0": ""})
    if not _is_classifier(config) or labels != 1:
        raise ConfigError(
            f"{what}: {folder} is not a reward model (architectures {config.get('architectures') or []}, {labels} "
            "label(s)); give a ...ForSequenceClassification folder with one label (train one with `tierlm rm`)"
        )
    if config.get("pad_token_id") is None:
        raise ConfigError(f"{what}: {folder}/config.json has no pad_token_id, so the last token of a row is unknown")
    return config


class RewardScorer:
    """A reward model folder run by transformers (`AutoModelForSequenceClassification`), frozen: the score of
    each token sequence (prompt + completion), in batches of `batch_size` rows padded on the right."""

    def __init__(self, folder: str | Path, device: torch.device | str = "cpu", batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification

        config = check_reward_model_folder(Path(folder), "the reward model")
        self.model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32)
        self.model.to(device).eval().requires_grad_(False)
        self.pad_id, self.device, self.batch_size = config["pad_token_id"], torch.device(device), batch_size

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[float]:
        out = []
        for start in range(0, len(sequences), self.batch_size):
            rows = sequences[start : start + self.batch_size]
            ids = torch.full((len(rows), max(map(len, rows))), self.pad_id, dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row)
            ids = ids.to(self.device)
            logits = self.model(input_ids=ids, attention_mask=(ids != self.pad_id).long()).logits
            out.extend(logits[:, 0].float().tolist())
        return out
