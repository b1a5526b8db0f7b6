"""Tier 1: Muon — momentum, then the update orthogonalised by a Newton–Schulz iteration.

Muon (Keller Jordan, 2024; nanochat's optimizer for the hidden matrices) treats each 2-D weight's
update as a matrix: it keeps a Nesterov momentum of the gradient and replaces it by the nearest
semi-orthogonal matrix (all singular values ~1) before stepping, so every direction of the matrix
learns at the same rate. Embeddings, the output head and vectors stay with AdamW (see
`tierlm.primitives.optim.create_muon_optimizer`).

Distributed: momentum is elementwise, so each rank keeps it for its own shard. The
orthogonalisation needs the whole matrix; each matrix is given to one rank (round robin), which
gathers it, orthogonalises it once, and broadcasts the result, so the work is split across ranks
and N ranks compute what one process computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from tierlm.errors import ConfigError

# The quintic's coefficients (Keller Jordan): chosen to push singular values in (0, 1] towards ~1
# as fast as possible in 5 steps, at the cost of leaving them in ~[0.7, 1.2] rather than exactly 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_orthogonalize(
    update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """An approximation of U V^T for update = U S V^T (the nearest semi-orthogonal matrix), by
    `steps` quintic Newton–Schulz iterations computed in `dtype`.

    >>> g = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    >>> s = torch.linalg.svdvals(newton_schulz_orthogonalize(g, dtype=torch.float32))
    >>> bool(s.min() > 0.5), bool(s.max() < 1.3)
    (True, True)
    """
    assert update.ndim == 2, f"Muon orthogonalises matrices, got shape {tuple(update.shape)}"
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the wide side: X X^T is then the smaller square
        x = x.T
    x = x / (x.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(update.dtype)


def get_muon_momentum(step: int, warmup_steps: int = 300, start: float = 0.85, end: float = 0.95) -> float:
    """Muon's momentum at `step`: linear from `start` to `end` over `warmup_steps` (nanochat).

    >>> [round(get_muon_momentum(s), 3) for s in (0, 150, 300, 1000)]
    [0.85, 0.9, 0.95, 0.95]
    """
    frac = min(step / warmup_steps, 1.0) if warmup_steps > 0 else 1.0
    return (1 - frac) * start + frac * end


def get_weight_decay(step: int, num_training_steps: int, weight_decay: float) -> float:
    """Weight decay at `step`, falling linearly from `weight_decay` to 0 at the last step (nanochat).

    >>> [get_weight_decay(s, 4, 0.2) for s in (0, 2, 4)]
    [0.2, 0.1, 0.0]
    """
    return weight_decay * max(0.0, 1 - step / num_training_steps)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole matrix of a (possibly FSDP-sharded) tensor, on every rank."""
    return t.full_tensor() if hasattr(t, "device_mesh") else t


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` is: this rank's shard of it, as a DTensor, when `like` is one."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import DTensor, Replicate

    replicated = DTensor.from_local(full, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    return replicated.redistribute(like.device_mesh, like.placements)  # Replicate -> Shard: a local slice, no traffic


class Muon(Optimizer):
    """Muon over 2-D parameters: Nesterov momentum, Newton–Schulz orthogonalisation, decoupled weight decay.

    Each update is `lr * sqrt(max(1, rows / cols))` times the orthogonalised momentum (a matrix
    with more rows than columns has smaller entries after orthogonalisation; the factor evens the
    step per element out). `ns_dtype=None` computes the iteration in bf16 on GPUs and fp32 on CPU.
    `distributed=True` (every rank holds the same full gradients, as after DDP; FSDP2's DTensor
    shards are detected) splits the orthogonalisations across the ranks of `group` (default: the whole job; under
    pipeline parallelism, the ranks holding the same stage, which the model-parallel backend sets).

    >>> w = torch.nn.Parameter(torch.zeros(4, 4))
    >>> opt = Muon([w], lr=0.1)
    >>> w.grad = torch.diag(torch.tensor([100.0, 10.0, 1.0, 0.1])); opt.step()
    >>> [round(x, 2) for x in (-w.diag()).tolist()]   # every direction moves by about lr, whatever its gradient
    [0.07, 0.07, 0.07, 0.05]
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        ns_dtype: torch.dtype | None = None,
        distributed: bool = False,
    ):
        if not 0 < lr < 1:
            raise ConfigError(f"Muon lr must be in (0, 1), got {lr}")
        if not 0 <= momentum < 1:
            raise ConfigError(f"Muon momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ConfigError(f"Muon ns_steps must be >= 1, got {ns_steps}")
        if weight_decay < 0:
            raise ConfigError(f"Muon weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                assert p.ndim == 2, (
                    f"Muon takes matrices only; a parameter of shape {tuple(p.shape)} belongs with AdamW"
                )
        self.ns_dtype = ns_dtype
        self.distributed = distributed
        self.group = None
        """The ranks that hold these same parameters (None: every rank of the job)."""

    def _ns_dtype(self, t: torch.Tensor) -> torch.dtype:
        if self.ns_dtype is not None:
            return self.ns_dtype
        return torch.bfloat16 if t.device.type == "cuda" else torch.float32

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (parameter, its group, the momentum direction: this rank's shard)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])  # buf = m * buf + (1 - m) * g
                direction = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                work.append((p, group, direction))
        for (p, group, _), update in zip(work, self._orthogonalized(work)):
            rows, cols = p.shape
            lr = group["lr"]
            if group["weight_decay"]:
                p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-lr * max(1.0, rows / cols) ** 0.5)
        return loss

    def _orthogonalized(self, work: list) -> list[torch.Tensor]:
        """Each direction orthogonalised once: by this process, or by its owner rank, then shared."""
        sharded = any(hasattr(d, "device_mesh") for _, _, d in work)
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if not (self.distributed or sharded) or world == 1:
            return [newton_schulz_orthogonalize(_full(d), g["ns_steps"], self._ns_dtype(d)) for _, g, d in work]
        rank = dist.get_rank(self.group)
        fulls = [_full(d) for _, _, d in work]  # FSDP: all-gathers each matrix (DDP: already whole)
        results, pending = [], []
        for i, ((_, group, direction), full) in enumerate(zip(work, fulls)):
            owner = i % world
            if owner == rank:
                out = newton_schulz_orthogonalize(full, group["ns_steps"], self._ns_dtype(full)).contiguous()
            else:
                out = torch.empty_like(full)
            source = owner if self.group is None else dist.get_global_rank(self.group, owner)
            pending.append(dist.broadcast(out, src=source, group=self.group, async_op=True))
            results.append(out)
        for handle in pending:
            handle.wait()
        return [_shard_like(full, direction) for full, (_, _, direction) in zip(results, work)]
