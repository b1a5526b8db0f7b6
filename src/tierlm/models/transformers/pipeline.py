"""Pipeline stages of transformers' Llama-style causal LMs (Llama, Mistral, Qwen2, Qwen3).

A stage is the decoder layers `block_ids` of the model — with the token embedding on the first stage, the
final norm and the head on the last — under the model's own parameter names (`model.layers.<i>....`), so
its state dict is a slice of the whole model's, and it runs them as the model's own forward does: the same
rotary embedding, and the same causal (or sliding-window) masks from transformers' mask helpers, packed
documents included (the masks read `position_ids`).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from tierlm.primitives.model_parallel import received_positions


@functools.cache
def _cache_argument() -> str:
    """What transformers' mask builders call the KV cache: `cache` (recent releases), `past_key_values` before (now
    deprecated there)."""
    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


class TransformersStage(nn.Module):
    """One pipeline stage of a transformers `*ForCausalLM` (Llama-style). A head tied to the embedding
    (`tie_word_embeddings`) makes the last stage hold the embedding too (its head's weight), registered
    first as in the whole model; the backend sums the two copies' gradients.

    >>> from transformers import Qwen3Config, Qwen3ForCausalLM
    >>> hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    >>> ids, positions = torch.randint(0, 50, (2, 8)), torch.arange(8).expand(2, 8)
    >>> x, positions = TransformersStage(hf, [0], first=True, last=False)(ids, positions)
    >>> logits = TransformersStage(hf, [1], first=False, last=True)(x, positions)
    >>> bool(torch.allclose(logits, hf(ids).logits, atol=1e-5))
    True
    """

    is_pipeline_stage = True  # its state dict is a slice of the whole model's (checkpoints load the slice)

    def __init__(self, model: nn.Module, block_ids: list[int], first: bool, last: bool):
        super().__init__()
        inner, config = model.model, model.config
        self.config, self.first = config, first
        self.model = nn.Module()  # the names of the whole model: model.embed_tokens, model.layers.<i>, model.norm
        tied = model.get_output_embeddings().weight is inner.embed_tokens.weight
        self.model.embed_tokens = inner.embed_tokens if first or (last and tied) else None
        self.model.layers = nn.ModuleDict({str(i): inner.layers[i] for i in block_ids})
        self.model.norm = inner.norm if last else None
        self.model.rotary_emb = inner.rotary_emb
        self.lm_head = model.lm_head if last else None
        sliding = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
        self.layer_types = getattr(config, "layer_types", None) or [sliding] * config.num_hidden_layers

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        position_ids = received_positions(position_ids, self.config.max_position_embeddings)
        if self.first:
            x = self.model.embed_tokens(x)
        masks = dict(config=self.config, inputs_embeds=x, attention_mask=None, position_ids=position_ids)
        masks[_cache_argument()] = None  # no cache: one whole forward per micro-batch
        wanted = {self.layer_types[int(i)] for i in self.model.layers}
        mask = {
            kind: (create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask)(**masks)
            for kind in wanted
        }
        position_embeddings = self.model.rotary_emb(x, position_ids)
        for i, layer in self.model.layers.items():
            out = layer(
                x,
                attention_mask=mask[self.layer_types[int(i)]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )
            x = out[0] if isinstance(out, tuple) else out
        if self.lm_head is None:
            return x, position_ids.float()
        return self.lm_head(self.model.norm(x))
