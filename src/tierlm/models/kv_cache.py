"""The KV cache of the native families' incremental decoding: one preallocated buffer of keys and values per layer."""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's keys and values for incremental decoding, preallocated to `max_len` positions."""

    def __init__(self, batch: int, n_kv_head: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_kv_head, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0
        self.first = 0
        """Positions before it hold nothing any row attends to (a continuous batch's rows that all started later):
        attention reads the keys from here on. Without a `position` only."""
        self.mask: torch.Tensor | None = None
        """(B, max_len) bool, which positions hold each row's own keys: rows of a continuous batch start at different
        positions (`tierlm.rollout.batching`); None: every row holds every position. With a `position`, marked ahead
        of time, the positions still to come included (the step writes nothing to it)."""
        self.position: torch.Tensor | None = None
        """A one-element long tensor on the cache's device: where the next token goes, for a decode step whose
        shapes never change (`tierlm.rollout.static_decode`, captured in a CUDA graph): the token written in place
        there, attention over the whole buffer with the later positions masked. None: `length`, a Python int, slices
        the buffer (prefill, and eager decoding)."""

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, position: torch.Tensor | None):
        """A layer cache over given keys and values (views of a larger cache's, say): nothing allocated."""
        layer = cls.__new__(cls)
        layer.k, layer.v, layer.length, layer.first, layer.mask, layer.position = k, v, 0, 0, mask, position
        return layer

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store T new positions; return all cached keys and values (B, Hkv, length, D) — with a `position`, one
        token stored there and the whole buffer returned (B, Hkv, max_len, D)."""
        if self.position is not None:
            assert k.shape[2] == 1, "a decode step at a tensor position takes one token per row"
            self.k.index_copy_(2, self.position, k)
            self.v.index_copy_(2, self.position, v)
            return self.k, self.v
        end = self.length + k.shape[2]
        assert end <= self.k.shape[2], f"KV cache full: {end} positions > {self.k.shape[2]}"
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        if self.mask is not None:
            self.mask[:, self.length : end] = True
        self.length = end
        return self.k[:, :, self.first : end], self.v[:, :, self.first : end]

    def attention_mask(self) -> torch.Tensor | None:
        """The keys each row's new query may see, (B, 1, 1, length - first); None when every row holds them all. With
        a `position`: (B or 1, 1, 1, max_len), the positions up to it."""
        if self.position is not None:
            seen = torch.arange(self.k.shape[2], device=self.k.device) <= self.position
            return (seen if self.mask is None else self.mask & seen).view(-1, 1, 1, self.k.shape[2])
        return None if self.mask is None else self.mask[:, None, None, self.first : self.length]

    def repeat(self, n: int) -> None:
        """Copy each row n times (a prompt prefilled once, then sampled n ways)."""
        self.k, self.v = self.k.repeat_interleave(n, dim=0), self.v.repeat_interleave(n, dim=0)


class KVCache:
    """Keys and values of every layer of a native model (its config: depth, num_kv_heads, head_dim, max_seq_len), for
    `forward(..., cache=...)` of the native GPT, GPT-2 and `NativeCausalLM`s."""

    def __init__(self, config, batch: int, max_len: int, device, dtype=torch.float32):
        assert max_len <= config.max_seq_len, f"max_len {max_len} > the model's max_seq_len {config.max_seq_len}"
        self.layers = [
            LayerCache(batch, config.num_kv_heads, max_len, config.head_dim, device, dtype) for _ in range(config.depth)
        ]

    @classmethod
    def over(cls, layers: list[LayerCache]) -> KVCache:
        """A cache of the given layer caches (`LayerCache.over`)."""
        cache = cls.__new__(cls)
        cache.layers = layers
        return cache

    def rows(self, start: int, end: int, length: int | None = None) -> KVCache:
        """Rows [start, end) of this cache, every layer's keys and values viewed (nothing copied), holding `length`
        positions (None: this cache's)."""
        layers = [LayerCache.over(layer.k[start:end], layer.v[start:end], None, None) for layer in self.layers]
        for layer in layers:
            layer.length = self.length if length is None else length
        return KVCache.over(layers)

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def position(self) -> torch.Tensor | None:
        """The tensor position of a fixed-shape decode step (`LayerCache.position`), shared by every layer."""
        return self.layers[0].position

    @position.setter
    def position(self, position: torch.Tensor | None) -> None:
        for layer in self.layers:
            layer.position = position

    def repeat(self, n: int) -> None:
        for layer in self.layers:
            layer.repeat(n)
