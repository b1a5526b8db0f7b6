"""GPT-2 research variant on the MLP: R-MLP.

**R-MLP** ("reciprocal MLP"): the hidden units of the MLP are split into a standard part and R_ff
reciprocal units, each scaled by a learned gate before the down projection:

    y = W_down [w_std GELU(W_up_std x) | w_rec GELU(W_up_rec x')]

with the gates initialised to the width shares ((H - R_ff) / H and R_ff / H). Options:
- `mixer`: a learned R_ff x R_ff linear map on the reciprocal units (initialised to the identity);
- `gate_alpha`: one more learned scalar on the reciprocal units (initialised to 1);
- `attention_aware`: the reciprocal units read x' = x + a * attention_output (a learned, init 0)
  instead of x alone.

The module keeps GPT-2's `c_fc` / `c_proj` weights (one up projection, split after it), so a plain
GPT-2's weights load into it unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.models.gpt2.ra import MIN_GATE


class ReciprocalMLP(nn.Module):
    def __init__(
        self,
        n_embd: int,
        hidden: int,
        r_ff: int,
        bias: bool,
        dropout: float,
        mixer: bool,
        gate_alpha: bool,
        attention_aware: bool,
    ):
        super().__init__()
        assert 0 < r_ff < hidden, f"R-MLP needs 0 < R_ff < the hidden width {hidden}, got {r_ff}"
        self.hidden, self.r_ff = hidden, r_ff
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.w_std = nn.Parameter(torch.empty(1))
        self.w_rec = nn.Parameter(torch.empty(1))
        self.mixer = nn.Linear(r_ff, r_ff, bias=False) if mixer else None
        self.gate_alpha = nn.Parameter(torch.empty(1)) if gate_alpha else None
        self.attn_alpha = nn.Parameter(torch.empty(1)) if attention_aware else None

    @torch.no_grad()
    def init_weights(self) -> None:
        """The gates and options (the projections are initialised by the model, as GPT-2's)."""
        self.w_std.fill_((self.hidden - self.r_ff) / self.hidden)
        self.w_rec.fill_(self.r_ff / self.hidden)
        if self.mixer is not None:
            nn.init.eye_(self.mixer.weight)
        if self.gate_alpha is not None:
            self.gate_alpha.fill_(1.0)
        if self.attn_alpha is not None:
            self.attn_alpha.zero_()

    def forward(
        self, x: torch.Tensor, attention_out: torch.Tensor | None = None, coupling: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`coupling`: the delayed-activation scale on the reciprocal gate (None: no delay)."""
        pre = self.c_fc(x)  # (B, T, hidden)
        std, rec = pre[..., : self.hidden - self.r_ff], pre[..., self.hidden - self.r_ff :]
        if (
            self.attn_alpha is not None and attention_out is not None
        ):  # the reciprocal units also read the attention output
            rec = rec + self.attn_alpha * F.linear(attention_out, self.c_fc.weight[self.hidden - self.r_ff :])
        std, rec = F.gelu(std, approximate="tanh"), F.gelu(rec, approximate="tanh")
        if self.mixer is not None:
            rec = self.mixer(rec)
        if self.gate_alpha is not None:
            rec = rec * self.gate_alpha
        w_rec = self.w_rec.clamp(min=MIN_GATE) * (coupling if coupling is not None else 1.0)
        hidden = torch.cat([self.w_std.clamp(min=MIN_GATE) * std, w_rec * rec], dim=-1)
        return self.dropout(self.c_proj(hidden))

    def gate_stats(self) -> dict[str, torch.Tensor]:
        stats = {"rmlp_w_std": self.w_std.detach(), "rmlp_w_rec": self.w_rec.detach()}
        if self.gate_alpha is not None:
            stats["rmlp_gate_alpha"] = self.gate_alpha.detach()
        if self.attn_alpha is not None:
            stats["rmlp_attention_alpha"] = self.attn_alpha.detach()
        return stats
