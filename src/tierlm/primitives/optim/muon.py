"""Tier 1: Muon — momentum, then the update orthogonalised by a Newton–Schulz iteration.

Muon (Keller Jordan, 2024; nanochat's optimizer for the hidden matrices) treats each 2-D weight's
update as a matrix: it keeps a Nesterov momentum of the gradient and replaces it by the nearest
semi-orthogonal matrix (all singular values ~1) before stepping, so every direction of the matrix
learns at the same rate. Embeddings, the output head and vectors stay with AdamW (see
`tierlm.primitives.optim.create_muon_optimizer`).

Refinements (`Muon(refinements=...)`, each one function below; nanochat's optimizer runs all five):
- `polar_express`: the Polar Express iteration (Amsel, Persson, Musco & Gower, 2025) — a different quintic per step,
  chosen so 5 steps land every singular value near 1 instead of in Newton–Schulz's ~[0.7, 1.2];
- `muoneq`: MuonEq's row equilibration — every row of the momentum scaled to the mean row norm before the
  orthogonalisation, so the spectrum it starts from is better conditioned;
- `renormalize`: Muon+ — the orthogonalised update's Frobenius norm snapped to sqrt(min(rows, cols)), an exactly
  semi-orthogonal matrix's;
- `normuon`: NorMuon (Li et al., 2025) — each neuron's update divided by the root of an EMA (beta2) of its mean
  square, then the whole rescaled to its norm before, so no neuron's update dominates;
- `cautious_wd`: cautious weight decay — only the entries the update already moves toward zero are decayed.

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
# Polar Express's quintics, one per step (num_iters=5, safety_factor=2e-2, cushion=2; the paper's, as nanochat runs
# them): the first widens small singular values fast, the last ones settle them at ~1.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
REFINEMENTS = ("polar_express", "muoneq", "renormalize", "normuon", "cautious_wd")


def newton_schulz_orthogonalize(
    update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16, polar_express: bool = False
) -> torch.Tensor:
    """An approximation of U V^T for update = U S V^T (the nearest semi-orthogonal matrix), by
    `steps` quintic Newton–Schulz iterations computed in `dtype` (Polar Express's quintics with `polar_express`).

    >>> g = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    >>> s = torch.linalg.svdvals(newton_schulz_orthogonalize(g, dtype=torch.float32))
    >>> bool(s.min() > 0.5), bool(s.max() < 1.3)
    (True, True)
    >>> s = torch.linalg.svdvals(newton_schulz_orthogonalize(g, dtype=torch.float32, polar_express=True))
    >>> bool(s.min() > 0.85), bool(s.max() < 1.15)
    (True, True)
    """
    assert update.ndim == 2, f"Muon orthogonalises matrices, got shape {tuple(update.shape)}"
    assert not polar_express or steps <= len(POLAR_EXPRESS_COEFFICIENTS), "Polar Express has 5 quintics"
    coefficients = POLAR_EXPRESS_COEFFICIENTS[:steps] if polar_express else [NS_COEFFICIENTS] * steps
    x = update.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the wide side: X X^T is then the smaller square
        x = x.T
    # spectral norm <= Frobenius norm <= 1: inside the iteration's basin (Polar Express keeps a 1% margin)
    x = x / (x.norm() * 1.01 + 1e-6) if polar_express else x / (x.norm() + 1e-7)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(update.dtype)


def equilibrate_rows(update: torch.Tensor) -> torch.Tensor:
    """MuonEq: every row rescaled to the root-mean-square row norm (the Frobenius norm is kept).

    >>> g = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    >>> e = equilibrate_rows(g); e.norm(dim=1).tolist(), round(float(e.norm()), 4) == round(float(g.norm()), 4)
    ([3.6055..., 3.6055...], True)
    """
    target = update.norm() / update.shape[0] ** 0.5
    return update * (target / update.norm(dim=1, keepdim=True).clamp_min(1e-6))


def renormalize(update: torch.Tensor) -> torch.Tensor:
    """Muon+: the update's Frobenius norm set to sqrt(min(rows, cols)), that of an exactly semi-orthogonal matrix.

    >>> round(float(renormalize(torch.ones(2, 8)).norm()) ** 2, 4)
    2.0
    """
    return update * (min(update.shape) ** 0.5 / update.norm().clamp_min(1e-6))


def normuon_scale(update: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon: each neuron's share of `update` divided by the root of the EMA of its mean square (`second_moment`,
    updated in place: (rows, 1) for a matrix at least as tall as wide, else (1, cols)), the result rescaled to the
    update's Frobenius norm.

    >>> u, v = torch.tensor([[2.0, 2.0], [0.5, 0.5]]), torch.zeros(2, 1)
    >>> normuon_scale(u, v, beta2=0.0)      # both rows now the same size, the norm kept
    tensor([[1.4577, 1.4577],
            [1.4577, 1.4577]])
    """
    dim = -1 if update.shape[0] >= update.shape[1] else -2
    mean_square = update.float().square().mean(dim=dim, keepdim=True)
    second_moment.lerp_(mean_square.to(second_moment.dtype), 1 - beta2)
    scaled = update * second_moment.clamp_min(1e-10).rsqrt().to(update.dtype)
    return scaled * (update.norm() / scaled.norm().clamp_min(1e-10))


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


def _neuron_vector(update: torch.Tensor) -> torch.Tensor:
    """NorMuon's second moment for `update`: an entry per row of a tall (or square) matrix, per column of a wide one."""
    rows, cols = update.shape
    return torch.zeros((rows, 1) if rows >= cols else (1, cols), dtype=torch.float32, device=update.device)


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
        refinements: tuple[str, ...] = (),
        beta2: float = 0.95,
    ):
        if not 0 < lr < 1:
            raise ConfigError(f"Muon lr must be in (0, 1), got {lr}")
        if not 0 <= momentum < 1:
            raise ConfigError(f"Muon momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ConfigError(f"Muon ns_steps must be >= 1, got {ns_steps}")
        if weight_decay < 0:
            raise ConfigError(f"Muon weight_decay must be >= 0, got {weight_decay}")
        unknown = sorted(set(refinements) - set(REFINEMENTS))
        if unknown:
            raise ConfigError(f"unknown Muon refinement(s) {unknown}: choose from {list(REFINEMENTS)}")
        if not 0 <= beta2 < 1:
            raise ConfigError(f"Muon beta2 (NorMuon's) must be in [0, 1), got {beta2}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                assert p.ndim == 2, (
                    f"Muon takes matrices only; a parameter of shape {tuple(p.shape)} belongs with AdamW"
                )
        self.ns_dtype = ns_dtype
        self.distributed = distributed
        self.refinements = frozenset(refinements)
        self.beta2 = beta2
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
        for (p, group, direction), full in zip(work, self._orthogonalized(work)):
            if "normuon" in self.refinements:  # on the whole matrix: every rank holds the same (rows or cols) vector
                moment = self.state[p].setdefault("second_moment", _neuron_vector(full))
                full = normuon_scale(full, moment, self.beta2)
            update = _shard_like(full, direction)
            rows, cols = p.shape
            lr = group["lr"]
            if group["weight_decay"] and "cautious_wd" in self.refinements:
                p.sub_(lr * group["weight_decay"] * p * (update * p >= 0))
            elif group["weight_decay"]:
                p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-lr * max(1.0, rows / cols) ** 0.5)
        return loss

    def _orthogonalize(self, full: torch.Tensor, steps: int) -> torch.Tensor:
        """One whole matrix's direction orthogonalised, with the refinements that act on it before and after."""
        if "muoneq" in self.refinements:
            full = equilibrate_rows(full.float())
        out = newton_schulz_orthogonalize(full, steps, self._ns_dtype(full), "polar_express" in self.refinements)
        return renormalize(out) if "renormalize" in self.refinements else out

    def _orthogonalized(self, work: list) -> list[torch.Tensor]:
        """Each direction orthogonalised once, as a whole matrix: by this process, or by its owner rank, then shared."""
        sharded = any(hasattr(d, "device_mesh") for _, _, d in work)
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if not (self.distributed or sharded) or world == 1:
            return [self._orthogonalize(_full(d), g["ns_steps"]).to(d.dtype) for _, g, d in work]
        rank = dist.get_rank(self.group)
        fulls = [_full(d) for _, _, d in work]  # FSDP: all-gathers each matrix (DDP: already whole)
        results, pending = [], []
        for i, ((_, group, direction), full) in enumerate(zip(work, fulls)):
            owner = i % world
            if owner == rank:
                out = self._orthogonalize(full, group["ns_steps"]).to(full.dtype).contiguous()
            else:
                out = torch.empty_like(full)
            source = owner if self.group is None else dist.get_global_rank(self.group, owner)
            pending.append(dist.broadcast(out, src=source, group=self.group, async_op=True))
            results.append(out)
        for handle in pending:
            handle.wait()
        return results
