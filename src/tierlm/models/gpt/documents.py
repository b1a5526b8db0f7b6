"""Where packed documents lie in a row, and how attention keeps inside each one (and inside a sliding window): the
masks and the per-document attention the native GPT and GPT-2 share. A new document starts wherever the position
does not continue the previous one, as transformers reads packed `position_ids`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask (B, 1, T, T) for packed rows: causal, and never across documents.

    A new document starts wherever the position does not continue the previous one (as
    transformers reads packed `position_ids`).

    >>> document_causal_mask(torch.tensor([[0, 1, 0, 1]]))[0, 0].int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 0, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    B, T = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    doc_ids = starts.cumsum(dim=1)  # (B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :])).unsqueeze(1)


def document_lengths(position_ids: torch.Tensor) -> list[list[int]]:
    """For each packed row, the lengths of its documents (a document starts where positions restart).

    >>> document_lengths(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]))
    [[3, 2], [5]]
    """
    B, T = position_ids.shape
    if is_fake(position_ids):  # the memory planner's fake tensors carry no values: one document a row
        return [[T] for _ in range(B)]
    restarts = torch.ones_like(position_ids, dtype=torch.bool)
    restarts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    lengths = []
    for starts in (row.nonzero().squeeze(1).tolist() for row in restarts):
        lengths.append([end - start for start, end in zip(starts, starts[1:] + [T])])
    return lengths


@dataclass
class PackedDocuments:
    """Where the documents of packed rows lie: their `position_ids` (B, T), and each row's
    document lengths, read on the host (free on CPU)."""

    position_ids: torch.Tensor
    lengths: list[list[int]]


def packed_mask(position_ids: torch.Tensor) -> PackedDocuments | torch.Tensor:
    """How attention sees packed documents: on the CPU each is attended alone (`PackedDocuments`: no mask, no work
    across documents); on a GPU finding them would cost a host sync, so one call with the (B, 1, T, T) mask.

    >>> packed_mask(torch.tensor([[0, 1, 0, 1, 2]])).lengths
    [[2, 3]]
    """
    if position_ids.device.type == "cpu":
        return PackedDocuments(position_ids, document_lengths(position_ids))
    return document_causal_mask(position_ids)


def attend_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[list[int]]) -> torch.Tensor:
    """Causal attention inside each document of each row, (B, H, T, D): what the document mask
    computes, without the (T, T) mask or the work of its empty blocks (a row of n equal documents
    costs ~1/n of the masked call). Split and concatenated, so the backward is one concatenation."""
    gqa = k.shape[1] != q.shape[1]
    if all(len(row) == 1 for row in lengths):  # one document a row: plain causal attention, one call
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    rows = []
    for qb, kb, vb, row in zip(q.unbind(0), k.unbind(0), v.unbind(0), lengths):  # (H, T, D) each
        parts = [
            F.scaled_dot_product_attention(
                qd[None], kd[None], vd[None], is_causal=True, enable_gqa=gqa
            )  # 4-D: the flash kernel
            for qd, kd, vd in zip(qb.split(row, dim=1), kb.split(row, dim=1), vb.split(row, dim=1))
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return torch.cat(rows)


def window_mask(queries: int, keys: int, window: int, device) -> torch.Tensor:
    """Boolean (queries, keys) mask: causal, and each query sees at most `window` keys (itself
    included); the queries are the last `queries` positions of the `keys`.

    >>> window_mask(4, 4, 2, "cpu").int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    q = torch.arange(keys - queries, keys, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    return (k <= q) & (q - k < window)
