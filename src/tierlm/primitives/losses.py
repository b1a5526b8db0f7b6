"""Tier 1: token-level losses as pure functions.

Convention used everywhere in tierlm: `labels[b, t]` is the target for the logits at position
`t` (already shifted, as nanoGPT/nanochat "targets"); -100 marks a position that is not trained.
An optional `loss_mask` (0/1 or weights) multiplies the per-token loss.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

IGNORE_INDEX = -100

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def get_labels(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The batch's `labels`, or its `targets` (the nanoGPT name) when there are no labels.

    >>> get_labels({"input_ids": torch.tensor([[5, 6]]), "targets": torch.tensor([[6, 7]])})
    tensor([[6, 7]])
    """
    if "labels" in batch:
        return batch["labels"]
    assert "targets" in batch, f"batch needs 'labels' or 'targets', has {sorted(batch)}"
    return batch["targets"]


def token_weights(labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token weight (B, T) in fp32: 0 where the label is ignored, else `loss_mask` (or 1).

    >>> token_weights(torch.tensor([[4, -100, 2]]), torch.tensor([[0.5, 1.0, 1.0]]))
    tensor([[0.5000, 0.0000, 1.0000]])
    """
    weights = (labels != IGNORE_INDEX).float()
    if loss_mask is not None:
        weights = weights * loss_mask.float()
    return weights


def count_loss_tokens(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Number of trained tokens in a batch (a 0-dim fp32 tensor, no host sync).

    >>> count_loss_tokens({"labels": torch.tensor([[1, -100, 3]]), "loss_mask": torch.tensor([[1, 1, 0]])})
    tensor(1.)
    """
    return token_weights(get_labels(batch), batch.get("loss_mask")).sum()


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position (B, T) in fp32; 0 where the label is -100.

    Given per-token losses (B, T) already (a fused LM head computed them, see
    `label_cross_entropy_only`), returns them as they are.

    >>> logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])  # position 0 uniform, position 1 unlabelled
    >>> per_token_cross_entropy(logits, torch.tensor([[1, -100]])).round(decimals=4)  # ln 2, then 0
    tensor([[0.6931, 0.0000]])
    """
    if logits.dim() == labels.dim():
        return logits
    vocab_size = logits.shape[-1]
    losses = F.cross_entropy(
        logits.float().reshape(-1, vocab_size), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    if hasattr(losses, "full_tensor"):  # logits split by vocabulary, under loss_parallel(): the losses are replicated
        losses = losses.full_tensor()
    return losses.view(labels.shape)


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over trained tokens, and how many tokens were trained.

    The caller divides by the token count of the whole optimizer step (all micro-batches, all
    ranks); dividing per micro-batch would weight short micro-batches too much.

    >>> logits = torch.zeros(1, 2, 4)  # uniform over 4 classes: loss ln(4) per token
    >>> total, n = cross_entropy_sum(logits, torch.tensor([[0, -100]]))
    >>> round(total.item(), 4), n.item()
    (1.3863, 1.0)
    """
    weights = token_weights(labels, loss_mask)
    return (per_token_cross_entropy(logits, labels) * weights).sum(), weights.sum()


def label_cross_entropy_only(fn: Callable) -> Callable:
    """Mark a loss or metrics function that reads the logits only through `per_token_cross_entropy`
    of the batch's labels, weighted by `token_weights`: as a loss it is `cross_entropy_sum`.

    A backend may then skip the (B, T, V) logits: it computes the loss with the LM head fused
    into the cross-entropy (`linear_cross_entropy`), and passes metrics functions the per-token
    losses (B, T) in place of the logits.
    """
    fn.label_cross_entropy_only = True
    return fn


def reads_label_cross_entropy_only(fn: Callable | None) -> bool:
    """True for a function marked by `label_cross_entropy_only` (bound methods included).

    >>> marked = label_cross_entropy_only(lambda logits, batch: None)
    >>> reads_label_cross_entropy_only(marked), reads_label_cross_entropy_only(None)
    (True, False)
    """
    return bool(getattr(fn, "label_cross_entropy_only", False))


def splits_by_rows(blocks: int = 1) -> Callable[[Callable], Callable]:
    """Mark a loss `fn(logits, batch) -> (sum, count)` whose sum and count over a batch are the sums over any
    split of its rows into sub-batches, each taking the same slice of each of the batch's `blocks` equal blocks of
    rows: 1 when rows stand alone (the policy-gradient losses), 2 for a batch of N chosen then N rejected rows
    (DPO's pairs). Pipeline stages may then run it one micro-batch of rows at a time (`row_blocks`).

    >>> @splits_by_rows(2)
    ... def pairs_loss(logits, batch): ...
    >>> row_blocks(pairs_loss), row_blocks(cross_entropy_sum)
    (2, None)
    """

    def mark(fn: Callable) -> Callable:
        fn.row_blocks = blocks
        return fn

    return mark


def row_blocks(fn: Callable | None) -> int | None:
    """The `blocks` a loss was marked with by `splits_by_rows` (bound methods included); None when unmarked."""
    return getattr(fn, "row_blocks", None)


def _chunk_rows(vocab_size: int, budget_elements: int = 1 << 25) -> int:
    """Rows per chunk so one chunk's fp32 logits stay near `budget_elements` (128 MB)."""
    return max(64, budget_elements // vocab_size)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W.T, y_i), one chunk of rows at a time; see `linear_cross_entropy`."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_rows, with_grad):
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        want_hidden, want_weight = with_grad and ctx.needs_input_grad[0], with_grad and ctx.needs_input_grad[1]
        token_losses = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        w = weight.to(dtype)
        with torch.autocast(device_type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_rows):
                end = min(start + chunk_rows, hidden.shape[0])
                h, y, rw = (
                    hidden[start:end].to(dtype),
                    labels[start:end].clamp(min=0)[:, None],
                    weights[start:end, None],
                )
                logits = (h @ w.t()).float()  # (n, V): the only vocabulary-sized tensor, one chunk at a time
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                token_losses[start:end] = (lse - logits.gather(1, y)).squeeze(1) * (rw.squeeze(1) != 0)
                if want_hidden or want_weight:  # d(w * CE)/d logits = w * (softmax - onehot), computed now
                    grad = logits.sub_(lse).exp_()
                    grad.scatter_add_(1, y, torch.full_like(rw, -1.0))
                    grad = grad.mul_(rw).to(dtype)
                    if want_hidden:
                        grad_hidden[start:end] = (grad @ w).to(hidden.dtype)
                    if want_weight:
                        grad_weight += (grad.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(token_losses)
        return (token_losses * weights).sum(), token_losses

    @staticmethod
    def backward(ctx, grad_sum, _grad_token_losses):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = grad_hidden * grad_sum.to(grad_hidden.dtype) if grad_hidden is not None else None
        grad_weight = (grad_weight * grad_sum).to(ctx.weight_dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head and the cross-entropy fused: never the whole (N, V) logits at once.

    `hidden` (N, C) are final hidden states, `weight` (V, C) the LM head, `labels` (N,) the
    targets (-100: not trained), `weights` (N,) per-token loss weights (default: 1 where
    trained). Returns (sum_i weights_i * CE_i, the per-token losses (N,) with 0 where not
    trained). Rows are processed `chunk_rows` at a time (default: ~128 MB of fp32 logits) and the
    gradients of each chunk are computed in the forward pass (as Liger's fused linear
    cross-entropy), so memory is one chunk of logits instead of the logits, their fp32 copy and
    their gradient; on CPU the rows that are not trained are dropped first (on a GPU, finding
    them would cost a host sync, so there they are computed and weighted 0). The matmuls follow
    autocast; the softmax is fp32. Equal to `F.cross_entropy` on `hidden @ weight.T`:

    >>> h, w = torch.randn(6, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    >>> y = torch.tensor([1, 2, -100, 4, 5, 6])
    >>> total, per_token = linear_cross_entropy(h, w, y)
    >>> reference = F.cross_entropy(h @ w.T, y, ignore_index=-100, reduction="sum")
    >>> torch.allclose(total, reference), per_token[2].item()
    (True, 0.0)
    >>> g = torch.autograd.grad(total, (h, w)); r = torch.autograd.grad(reference, (h, w))
    >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g, r))
    True
    """
    assert hidden.dim() == 2 and labels.shape == hidden.shape[:1], (
        f"hidden {tuple(hidden.shape)} vs labels {tuple(labels.shape)}"
    )
    trained = labels != IGNORE_INDEX
    weights = trained.float() if weights is None else weights.float() * trained
    chunk_rows = chunk_rows or _chunk_rows(weight.shape[0])
    with_grad = torch.is_grad_enabled()  # under no_grad (eval) no gradient is precomputed
    if hidden.device.type == "cpu":
        # (under the memory planner's fake tensors every row counts as trained: the most it can hold)
        rows = torch.arange(len(labels), device=labels.device) if is_fake(labels) else trained.nonzero().squeeze(1)
        total, losses = _LinearCrossEntropy.apply(
            hidden[rows], weight, labels[rows], weights[rows], chunk_rows, with_grad
        )
        return total, torch.zeros(labels.shape, dtype=losses.dtype, device=losses.device).index_copy_(0, rows, losses)
    return _LinearCrossEntropy.apply(hidden, weight, labels, weights, chunk_rows, with_grad)


def create_cross_entropy_loss() -> LossFn:
    """A `loss_fn(logits, batch) -> scalar`: mean cross-entropy over the batch's trained tokens.

    `batch["labels"]` (or `targets`) uses -100 for ignored positions; an optional
    `batch["loss_mask"]` weights tokens. The backend re-weights each micro-batch by its token
    count, so accumulation is normalised by the tokens of the whole optimizer step.

    >>> loss_fn = create_cross_entropy_loss()
    >>> logits = torch.randn(2, 10, 100)  # (B, T, V)
    >>> batch = {"labels": torch.randint(0, 100, (2, 10)), "loss_mask": torch.ones(2, 10)}
    >>> loss = loss_fn(logits, batch)
    >>> loss.item() > 0
    True
    """

    @label_cross_entropy_only
    def cross_entropy_loss(logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        total, num_tokens = cross_entropy_sum(logits, get_labels(batch), batch.get("loss_mask"))
        return total / num_tokens.clamp(min=1.0)

    return cross_entropy_loss


def vocab_logprobs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) over the vocabulary (B, T, V), in float32 (temperature 0 or 1: the logits
    as they are).

    >>> vocab_logprobs(torch.log(torch.tensor([[[1.0, 3.0]]])), temperature=0.5).exp()  # p^2, renormalised
    tensor([[[0.1000, 0.9000]]])
    """
    scaled = logits.float() / temperature if temperature not in (0.0, 1.0) else logits.float()
    return torch.log_softmax(scaled, dim=-1)


def label_logprobs(vocab: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The log-probs (B, T) of `labels` in `vocab` (`vocab_logprobs`'); 0 where unlabelled.

    >>> vocab = torch.log(torch.tensor([[[0.2, 0.8], [0.5, 0.5]]]))
    >>> label_logprobs(vocab, torch.tensor([[1, -100]])).exp()  # p(1) = 0.8, then exp(0)
    tensor([[0.8000, 1.0000]])
    """
    return vocab.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (labels != IGNORE_INDEX)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The entropy (B, T) of softmax(logits / temperature) at every position, in float32.

    >>> token_entropy(torch.log(torch.tensor([[[0.5, 0.5], [1.0, 1e-30]]]))).round(decimals=4)  # ln 2, then ~0
    tensor([[0.6931, 0.0000]])
    """
    logprobs = vocab_logprobs(logits, temperature)
    return -(logprobs.exp() * logprobs).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(label) at every position (B, T) under softmax(logits / temperature); 0 where unlabelled.

    >>> lp = token_logprobs(torch.log(torch.tensor([[[0.25, 0.75]]])), torch.tensor([[1]]))
    >>> round(lp.exp().item(), 4)
    0.75
    """
    return label_logprobs(vocab_logprobs(logits, temperature), labels)
