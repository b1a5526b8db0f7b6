"""Tier 1: AdamWPrune — AdamW that prunes its weight matrices by scores read from its own state.

Every pruned matrix has a boolean mask. After `warmup` steps, every `frequency` steps the target
sparsity rises along s(t) = final * p^3, p = (t - warmup) / (total - warmup) (a cubic schedule),
one global ranking of all the pruned matrices' scores sets the masks (exactly the k lowest, or
below the quantile of a random sample of `sample_size` scores for large models), and masked
entries are zeroed in the weights, gradients and both Adam moments — they stay exactly zero.

Scores (`score`):
- `magnitude`: |w| (the baseline);
- `sqrt_momentum`: |w| * sqrt(|m|) (the code base's "bitter3");
- `fourth_root_v`: |w| * v^(1/4) (its "bitter7", its best);
- `movement`: -sum over steps of w * g (movement pruning, Sanh et al. 2020: weights moving towards
  zero score low), accumulated in the state.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from tierlm.errors import ConfigError
from tierlm.primitives.optim.adam import adamw_update_, init_adam_state

SCORES = ("magnitude", "sqrt_momentum", "fourth_root_v", "movement")


def target_sparsity(step: int, final: float, warmup: int, total: int) -> float:
    """s(t) = final * p^3 with p = (t - warmup) / (total - warmup), 0 before the warm-up ends.

    >>> [round(target_sparsity(t, 0.5, 10, 30), 4) for t in (0, 10, 20, 30, 40)]
    [0.0, 0.0, 0.0625, 0.5, 0.5]
    """
    if step <= warmup or total <= warmup:
        return 0.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    return final * progress**3


class AdamWPrune(Optimizer):
    """AdamW over `params`, pruning the groups marked `"prune": True` (see the module docstring).

    >>> w = torch.nn.Parameter(torch.tensor([[0.1, -2.0], [3.0, 0.2]]))
    >>> opt = AdamWPrune([{"params": [w], "prune": True}], lr=1e-3, score="magnitude", final_sparsity=0.5,
    ...                  warmup=0, frequency=1,
    ...                  total_steps=1)
    >>> w.grad = torch.zeros_like(w); opt.step()
    >>> opt.sparsity(), (w == 0).int().tolist()
    (0.5, [[1, 0], [0, 1]])
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        score: str = "fourth_root_v",
        final_sparsity: float = 0.5,
        warmup: int = 1000,
        frequency: int = 50,
        total_steps: int = 10000,
        sample_size: int = 1 << 22,
        seed: int = 0,
    ):
        if score not in SCORES:
            raise ConfigError(f"training.prune_score must be one of {list(SCORES)}, got {score!r}")
        if not 0 <= final_sparsity < 1:
            raise ConfigError(f"training.prune_sparsity must be in [0, 1), got {final_sparsity}")
        if frequency < 1 or warmup < 0:
            raise ConfigError(f"training.prune_frequency must be >= 1 and prune_warmup >= 0, got {frequency}, {warmup}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, prune=False)
        super().__init__(params, defaults)
        self.score, self.final_sparsity, self.warmup, self.frequency = score, final_sparsity, warmup, frequency
        self.total_steps, self.sample_size, self.seed = total_steps, sample_size, seed
        self._sparsity: float | None = None  # cached: read once per mask update, not per step

    def metrics(self) -> dict[str, float]:
        """{"sparsity": ...} for the train lines (no host sync but after a mask update or a resume)."""
        if self._sparsity is None:
            self._sparsity = self.sparsity()
        return {"sparsity": self._sparsity}

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():  # Optimizer.load_state_dict casts every state tensor to its parameter's dtype
            if "mask" in state:
                state["mask"] = state["mask"].bool()
        self._sparsity = None

    def _pruned(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups if g["prune"] for p in g["params"]]

    def sparsity(self) -> float:
        """The share of pruned-matrix entries masked now (0 before the first mask)."""
        masks = [self.state[p]["mask"] for p in self._pruned() if "mask" in self.state[p]]
        total = sum(p.numel() for p in self._pruned())
        return float(sum(int((~m).sum()) for m in masks)) / total if masks and total else 0.0

    def _score(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if self.score == "magnitude":
            return p.abs()
        if self.score == "sqrt_momentum":
            return p.abs() * state["exp_avg"].abs().sqrt()
        if self.score == "fourth_root_v":
            return p.abs() * state["exp_avg_sq"].sqrt().sqrt()
        return state["movement"]

    def _update_masks(self, sparsity: float) -> None:
        """One global ranking of every pruned matrix's scores (masked entries stay masked)."""
        params = self._pruned()
        scores = [torch.where(self.state[p]["mask"], self._score(p).float(), float("-inf")) for p in params]
        flat = torch.cat([s.flatten() for s in scores])
        k = int(sparsity * flat.numel())
        if k == 0:
            return
        if flat.numel() <= self.sample_size:  # exactly the k lowest scores (ties broken by position)
            keep = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
            keep[flat.argsort(stable=True)[:k]] = False
            for p, part in zip(params, keep.split([p.numel() for p in params])):
                self.state[p]["mask"] &= part.view_as(p)
        else:  # a large model: the quantile of a seeded random sample stands in for the k-th value
            g = torch.Generator(device="cpu").manual_seed(self.seed + k)
            sample = flat[torch.randint(0, flat.numel(), (self.sample_size,), generator=g).to(flat.device)]
            threshold = sample.quantile(sparsity)
            for p, s in zip(params, scores):
                self.state[p]["mask"] &= s > threshold
        self._sparsity = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    init_adam_state(state, p)
                    if group["prune"]:
                        state["mask"] = torch.ones_like(p, dtype=torch.bool)
                        if self.score == "movement":
                            state["movement"] = torch.zeros_like(p)
                g = p.grad.mul_(state["mask"]) if group["prune"] else p.grad
                if group["prune"] and self.score == "movement":
                    state["movement"].sub_(p * g)
                step = adamw_update_(p, g, state, group)
        if step and step > self.warmup and (step - self.warmup) % self.frequency == 0 and self._pruned():
            self._update_masks(target_sparsity(step, self.final_sparsity, self.warmup, self.total_steps))
        for p in self._pruned():  # weights and both moments follow the mask
            if "mask" in self.state[p]:
                mask = self.state[p]["mask"]
                p.mul_(mask)
                self.state[p]["exp_avg"].mul_(mask)
                self.state[p]["exp_avg_sq"].mul_(mask)
        return loss
