"""A mixture-of-experts feed-forward layer: a router picks each token's `experts_per_token` of `num_experts` SwiGLU
experts, their outputs are summed with the router's weights, and shared experts (DeepSeek's) see every token.

The weights are laid out and named as transformers' Qwen3-MoE's (`experts.gate_up_proj` (E, 2W, D),
`experts.down_proj` (E, D, W), the router's (E, D)), so a Qwen3-MoE block copies in as it is. Routing:

- scores: softmax over the experts (Qwen3-MoE, Mixtral) or a sigmoid per expert (DeepSeek-V3);
- selection: the top-k of score + `expert_bias`, DeepSeek-V3's auxiliary-loss-free balancing bias, which changes
  which experts are picked but never the weights they get (`balance_bias` moves it against the load);
- weights: the picked scores, renormalised to sum to 1 with `normalize_top_k`;
- replay: given the experts a sampler chose (`sampler_routes`, a (tokens, k) tensor of expert ids, -1 where unknown),
  the layer counts where its own choice agrees (`stats`), and with `replay` set uses the sampler's instead of its
  top-k — rollout routing replay (R3, Ma et al. 2025) for RL on MoE models. The weights stay the router's scores of
  the experts used, so the router still learns.

Expert compute is grouped: the tokens sorted by expert and one grouped matmul per projection
(`torch.nn.functional.grouped_mm`) where PyTorch has it for these shapes, else a loop over the experts that got
tokens. Each forward leaves `routes` (the experts used) and `stats` (the load-balancing loss of Switch / Qwen3-MoE,
the router z-loss, the tokens per expert) for the trainer to read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    experts_per_token: int
    expert_width: int
    """Each expert's SwiGLU hidden width (transformers' moe_intermediate_size)."""
    shared_experts: int = 0
    """Experts every token goes through, as one SwiGLU of shared_experts x expert_width (0: none)."""
    score: str = "softmax"
    """softmax over the experts (Qwen3-MoE) or sigmoid per expert (DeepSeek-V3)."""
    normalize_top_k: bool = True
    """Renormalise the picked experts' scores to sum to 1 (Qwen3-MoE's norm_topk_prob)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss (Switch's) added to the training loss, each layer's (Qwen3-MoE's
    router_aux_loss_coef; 0: none)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE's) added to the training loss, each layer's (0: none)."""
    bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's selection bias moves by this much toward balance
    after every optimizer step, from the tokens it got during the step (0: off)."""

    def __post_init__(self) -> None:
        assert 0 < self.experts_per_token <= self.num_experts, f"top-k {self.experts_per_token} of {self.num_experts}"
        assert self.score in ("softmax", "sigmoid"), f"unknown router score {self.score!r}"


class SwiGLU(nn.Module):
    def __init__(self, dim: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.up_proj = nn.Linear(dim, width, bias=False)
        self.down_proj = nn.Linear(width, dim, bias=False)
        self.gate_up_weight: torch.Tensor | None = None
        """gate's and up's weights as one matrix, set only while a fixed-shape decode step runs
        (`tierlm.rollout.static_decode.packed`): the two are one matmul; read only without gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None or torch.is_grad_enabled():  # (a plain tensor: no gradient reaches the weights)
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def load_balancing_loss(probs: torch.Tensor, routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as Qwen3-MoE computes it: E x sum_i f_i P_i, with f_i the share of tokens
    routed to expert i (summed over the k picks) and P_i the mean router probability of expert i.

    >>> probs = torch.full((4, 2), 0.5)
    >>> float(load_balancing_loss(probs, torch.tensor([[0], [1], [0], [1]]), 2))  # balanced: 1
    1.0
    """
    share = F.one_hot(routes, num_experts).float().sum(dim=1).mean(dim=0)
    return num_experts * (share * probs.float().mean(dim=0)).sum()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of `x` (sorted by expert, `counts` rows each) times each expert's `weight` (E, out, in) transposed: one
    grouped matmul where PyTorch has it for these shapes (16-byte aligned rows), else a loop over the experts (also
    on fake tensors, whose grouped matmul takes bf16 alone). The weight is cast to the rows' dtype (autocast does
    not reach the grouped matmul)."""
    out_dim, in_dim = weight.shape[1], weight.shape[2]
    weight = weight.to(x.dtype)
    aligned = (in_dim * x.element_size()) % 16 == 0 and (out_dim * x.element_size()) % 16 == 0
    if hasattr(F, "grouped_mm") and aligned and x.shape[0] > 0 and not is_fake(x):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return F.grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=offsets)
    parts, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            parts.append(F.linear(x[start : start + n], weight[expert]))
        start += n
    return torch.cat(parts) if parts else x.new_zeros(0, out_dim)


class GroupedExperts(nn.Module):
    """The experts' SwiGLUs, `x` (N, dim) sorted by expert with `counts` (E,) rows each -> (N, dim): one grouped matmul
    per projection (`grouped_linear`). Its own module, as transformers' Qwen3-MoE `experts`, so that expert
    parallelism (`tierlm.primitives.expert_parallel`) can hold a share of the experts and move the rows to them
    around its forward without the model knowing."""

    def __init__(self, num_experts: int, dim: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, width))
        nn.init.normal_(self.gate_up_proj, std=dim**-0.5)
        nn.init.normal_(self.down_proj, std=width**-0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        e = self.gate_up_proj.shape[0]
        # Traced on fake tensors (the memory planner), the split is unknown: an even one has the same total rows.
        sizes = [x.shape[0] // e + (i < x.shape[0] % e) for i in range(e)] if is_fake(counts) else counts.tolist()
        gate, up = grouped_linear(x, self.gate_up_proj, sizes).chunk(2, dim=-1)
        return grouped_linear(F.silu(gate) * up, self.down_proj, sizes)


class MoE(nn.Module):
    """The layer (see the module's docstring); `x` (..., dim) -> (..., dim)."""

    def __init__(self, dim: int, config: MoEConfig):
        super().__init__()
        self.config, e, w = config, config.num_experts, config.expert_width
        self.router = nn.Linear(dim, e, bias=False)
        self.experts = GroupedExperts(e, dim, w)
        self.register_buffer("expert_bias", torch.zeros(e))
        self.load: torch.Tensor | None = None
        """Tokens per expert routed in training since the last optimizer step (None: none yet)."""
        self.shared = SwiGLU(dim, w * config.shared_experts) if config.shared_experts else None
        self.sampler_routes: torch.Tensor | None = None
        """The experts a sampler chose for the next forward's rows, (N, k), -1 where unknown (None: none given)."""
        self.replay = False
        """Use `sampler_routes` where known instead of the router's own top-k (rollout routing replay)."""
        self.routes: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}

    def idle_params(self) -> int:
        """The expert parameters a token does not go through: the (E - k) / E share of the experts' (the active count
        of the model's size and FLOPs leaves them out)."""
        c = self.config
        return round(
            (c.num_experts - c.experts_per_token) / c.num_experts * sum(p.numel() for p in self.experts.parameters())
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """(experts (N, k), their weights (N, k), router logits (N, E), scores (N, E), agreement) of the rows of `x`
        (N, dim); agreement, given `sampler_routes`: the rows whose routes are known and those whose own top-k is the
        sampler's set (N,) bool each."""
        logits = self.router(x).float()
        scores = logits.softmax(dim=-1) if self.config.score == "softmax" else logits.sigmoid()
        experts = (scores + self.expert_bias).topk(self.config.experts_per_token, dim=-1).indices
        agreement = {}
        if self.sampler_routes is not None:
            sampler = self.sampler_routes.to(x.device)
            assert sampler.shape == experts.shape, f"sampler routes {tuple(sampler.shape)} for {tuple(experts.shape)}"
            known = (sampler >= 0).all(dim=-1)
            agree = (sampler.sort(dim=-1).values == experts.sort(dim=-1).values).all(dim=-1) & known
            agreement = {"route_known": known, "route_agree": agree}
            if self.replay:
                experts = torch.where(known[:, None], sampler.long(), experts)
        weights = scores.gather(1, experts)
        if self.config.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype), logits, scores, agreement

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k, e = x.shape, self.config.experts_per_token, self.config.num_experts
        rows = x.reshape(-1, shape[-1])
        experts, weights, logits, scores, agreement = self.route(rows)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        counts = torch.zeros(e, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        out = self.experts(rows[token], counts) * weights.reshape(-1)[order, None]
        y = torch.zeros_like(rows).index_add_(0, token, out.to(rows.dtype))
        if self.shared is not None:
            y = y + self.shared(rows)
        self.routes = experts.detach()
        probs = scores if self.config.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        self.stats = {
            **agreement,
            "load_balancing_loss": load_balancing_loss(probs, experts, e),
            "router_z_loss": torch.logsumexp(logits, dim=-1).pow(2).mean(),
            "tokens_per_expert": counts.detach(),
        }
        if self.training:  # the optimizer step reads it (the balancing bias, the imbalance reported)
            self.load = counts.detach() if self.load is None else self.load + counts.detach()
        return y.reshape(shape)

    def router_loss(self) -> torch.Tensor:
        """The last forward's terms for the training loss: aux_loss_coef x load balancing + z_loss_coef x z-loss."""
        c = self.config
        return c.aux_loss_coef * self.stats["load_balancing_loss"] + c.z_loss_coef * self.stats["router_z_loss"]

    @torch.no_grad()
    def balance_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: each expert's bias moves by `rate` toward balance (up when it
        got fewer tokens than the mean, down when more), after each optimizer step.

        >>> layer = MoE(8, MoEConfig(num_experts=3, experts_per_token=1, expert_width=4))
        >>> layer.balance_bias(torch.tensor([6, 2, 1]), rate=0.5)
        >>> layer.expert_bias.tolist()
        [-0.5, 0.5, 0.5]
        """
        load = tokens_per_expert.float()
        self.expert_bias += rate * torch.sign(load.mean() - load)
        self.load = None
