"""Reward modelling on preference pairs: the Bradley–Terry loss (InstructGPT, Ouyang et al., 2022; TRL's
RewardTrainer), on each sequence's score r at its last token:

    -log sigmoid(r_chosen - r_rejected - margin)  +  c (r_chosen + r_rejected)^2

`margin` comes from the data's `margin` column when it has one (Llama 2's margin loss), else 0; c is
`rm.center_rewards_coefficient` (Eisenstein et al., 2023's centring: scores stay near 0).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from tierlm.primitives.losses import IGNORE_INDEX

Batch = Mapping[str, torch.Tensor]


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None, center: float = 0.0
) -> torch.Tensor:
    """Per-pair loss of the chosen / rejected scores (N,).

    >>> bradley_terry_loss(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([1.0])).item()  # -log sigmoid(1)
    0.3132616877555847
    """
    diff = chosen - rejected - (margin if margin is not None else 0.0)
    return -F.logsigmoid(diff) + center * (chosen + rejected) ** 2


def last_token_index(labels: torch.Tensor) -> torch.Tensor:
    """Each row's last labelled position (B,): every pair row labels its final reply.

    >>> last_token_index(torch.tensor([[-100, 5, 6, -100], [-100, 7, -100, -100]])).tolist()
    [2, 1]
    """
    positions = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
    return torch.where(labels != IGNORE_INDEX, positions, -1).max(dim=1).values


class RewardStrategy:
    """A reward model (`tierlm.models.reward.add_score_head`) trained on pair batches (N chosen rows then N rejected,
    shifted as `PairLoader` makes them) by the ordinary `Trainer`; losses are counted in pairs."""

    def __init__(self, pad_id: int, center_rewards_coefficient: float = 0.0):
        self.pad_id, self.center = pad_id, center_rewards_coefficient

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The whole sequences (the shifted rows with their final token put back) and where each ends."""
        ids, labels = batch["input_ids"], batch["labels"]
        last = last_token_index(labels)
        assert bool((last >= 0).all()), "a preference row without a labelled reply"
        full = F.pad(ids, (0, 1), value=self.pad_id)
        rows = torch.arange(ids.shape[0])
        full[rows, last + 1] = labels[rows, last]
        out = {"input_ids": full, "score_index": last + 1}
        if "margin" in batch:
            out["margin"] = batch["margin"]
        return out

    def scores(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Each row's score at its last token (B,), in float32."""
        index = batch["score_index"].to(logits.device)
        return logits[..., 0].float().gather(1, index[:, None]).squeeze(1)

    def _pairs(self, logits: torch.Tensor, batch: Batch):
        scores = self.scores(logits, batch)
        n = scores.shape[0] // 2
        margin = batch["margin"].to(scores.device).float() if "margin" in batch else None
        return scores[:n], scores[n:], bradley_terry_loss(scores[:n], scores[n:], margin, self.center)

    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, losses = self._pairs(logits, batch)
        return losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)

    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        chosen, rejected, losses = self._pairs(logits, batch)
        return {
            "loss_sum": losses.sum(),
            "num_pairs": torch.tensor(float(losses.numel())),
            "margin_sum": (chosen - rejected).sum(),
            "score_sum": (chosen + rejected).sum(),
            "correct": ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).sum(),
        }

    @staticmethod
    def summarize(totals: Mapping[str, float]) -> dict[str, float]:
        """val_loss, rm_acc (the chosen reply scored higher), the mean score margin and the mean score.

        >>> RewardStrategy.summarize({"loss_sum": 2.0, "num_pairs": 4.0, "margin_sum": 6.0, "score_sum": 0.0,
        ...     "correct": 3.0})
        {'val_loss': 0.5, 'rm_acc': 0.75, 'score_margin': 1.5, 'score_mean': 0.0}
        """
        n = max(totals["num_pairs"], 1.0)
        return {
            "val_loss": totals["loss_sum"] / n,
            "rm_acc": totals["correct"] / n,
            "score_margin": totals["margin_sum"] / n,
            "score_mean": totals["score_sum"] / (2 * n),
        }
