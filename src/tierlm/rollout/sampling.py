"""Token sampling, and `generate`: one prompt by full recompute, the slow exact reference the
KV-cache `Engine` is tested against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tierlm.models import forward_logits, model_max_seq_len


@dataclass(frozen=True)
class SamplingParams:
    """How each next token is drawn, named as vLLM's and transformers' settings are: `temperature` (0: greedy), and
    the filters applied after it in transformers' order — `top_k` (the k most likely tokens), `top_p` (nucleus: the
    smallest set reaching p), `min_p` (tokens at least min_p times as likely as the most likely one; Nguyen et al.,
    2024) — each None when off — and, before all of them, the penalties OpenAI's and vLLM's servers take (0, 0, 1:
    off; `Penalties`): `presence_penalty` and `frequency_penalty` on the tokens generated so far,
    `repetition_penalty` (CTRL's, Keskar et al., 2019) on those and the prompt's.

    >>> SamplingParams(0.7, top_p=0.9).greedy, GREEDY.greedy
    (False, True)
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, section, temperature: float | None = None) -> "SamplingParams":
        """The settings of a config section that names them (`rl`), at `temperature` if given (an evaluation's).

        >>> from types import SimpleNamespace
        >>> params = SamplingParams.of(SimpleNamespace(temperature=1.0, top_k=None, top_p=0.95, min_p=0.05), 0.0)
        >>> params.temperature, params.top_p, params.min_p
        (0.0, 0.95, 0.05)
        """
        temperature = section.temperature if temperature is None else temperature
        return cls(temperature, section.top_k, section.top_p, section.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) in float32 over the temperature, those each filter drops set to -inf.

        >>> SamplingParams(1.0, min_p=0.5).filter(torch.tensor([[0.0, -0.5, -1.0]])).tolist()  # p / p_max: 1, .61, .37
        [[0.0, -0.5, -inf]]
        """
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and 0.0 < self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative - sorted_logits.softmax(dim=-1) > self.top_p  # keep the smallest set reaching top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        if self.min_p is not None and self.min_p > 0.0:
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < self.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        return logits


GREEDY = SamplingParams(0.0)


class Penalties:
    """The penalties of `params` over `rows` rows continuing `prompt_ids`, as vLLM applies them to the logits
    before the temperature: a token the prompt or a row's output holds has its logit divided by
    `repetition_penalty` if positive (multiplied if not); then each output token's logit loses
    `frequency_penalty` times its count and `presence_penalty` once. `add` counts the tokens each row is fed.

    >>> p = Penalties(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0), [0], 1, 4,
    ...               torch.device("cpu"))
    >>> p.add(torch.tensor([2])); p.add(torch.tensor([2]))
    >>> p.apply(torch.tensor([[1.0, 1.0, 1.0, -1.0]])).tolist()  # 0: the prompt's; 2: twice in the output
    [[0.5, 1.0, -0.5, -1.0]]
    """

    def __init__(self, params: SamplingParams, prompt_ids, rows: int, vocab: int, device: torch.device):
        self.params = params
        self.counts = torch.zeros(rows, vocab, device=device)
        self.prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.prompt[torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)] = True

    def add(self, tokens: torch.Tensor) -> None:
        self.counts.scatter_add_(1, tokens.view(-1, 1), torch.ones_like(tokens, dtype=self.counts.dtype).view(-1, 1))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        p, logits, generated = self.params, logits.float(), self.counts > 0
        if p.repetition_penalty != 1.0:
            penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(generated | self.prompt, penalised, logits)
        return logits - p.frequency_penalty * self.counts - p.presence_penalty * generated.float()


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams = SamplingParams(), generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, V).

    >>> sample_next_token(torch.tensor([[0.1, 3.0, 0.2]]), GREEDY)
    tensor([1])
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    uniform = torch.rand(logits.shape[:-1] + (1,), generator=generator, device=logits.device, dtype=torch.float32)
    return inverse_cdf(params.filter(logits), uniform)


def sample_groups(
    logits: torch.Tensor, params: SamplingParams, groups: list[tuple[int, torch.Generator | None]]
) -> torch.Tensor:
    """`sample_next_token` of each group of consecutive rows of `logits` (B, V), `(rows, generator)` in order, each
    with its own generator, in one pass: a group's tokens are those it draws alone. A group given None draws nothing
    (a group whose rows have all stopped: its tokens are read by nobody).

    >>> logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    >>> params = SamplingParams(0.9)
    >>> alone = [sample_next_token(logits[:2], params, torch.Generator().manual_seed(1)),
    ...          sample_next_token(logits[2:], params, torch.Generator().manual_seed(2))]
    >>> together = sample_groups(logits, params, [(2, torch.Generator().manual_seed(1)),
    ...                                           (3, torch.Generator().manual_seed(2))])
    >>> torch.equal(together, torch.cat(alone))
    True
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = params.filter(logits)
    uniform = [
        torch.rand((rows, 1), generator=g, device=logits.device, dtype=torch.float32)
        if g is not None
        else torch.zeros((rows, 1), device=logits.device)
        for rows, g in groups
    ]
    return inverse_cdf(logits, torch.cat(uniform))


def default_generator(device: torch.device) -> torch.Generator:
    """The generator torch's random functions draw from on `device` when given none.

    >>> default_generator(torch.device("cpu")) is torch.default_generator
    True
    """
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token each row's uniform number in [0, 1) (..., 1) picks from softmax(logits): one number per row and a
    binary search over the cumulative probabilities (torch.multinomial and Gumbel noise draw a random number per
    vocabulary entry)."""
    cdf = logits.float().softmax(dim=-1).cumsum(dim=-1)
    return torch.searchsorted(cdf, uniform * cdf[..., -1:]).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


def sample_rows(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator | None]) -> list[int]:
    """`sample_next_token` of each row of `logits` (B, V) at its own temperature with its own generator (None: the
    global one), in one pass over the batch: each row's token is the one `sample_next_token(logits[i:i+1], ...)`
    draws (its uniform number from its generator, in row order).

    >>> logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    >>> seeds = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    >>> alone = [int(sample_next_token(logits[i:i+1], SamplingParams(t), torch.Generator().manual_seed(s)))
    ...          for i, (t, s) in enumerate([(0.7, 1), (0.0, 2), (1.3, 3)])]
    >>> sample_rows(logits, [0.7, 0.0, 1.3], seeds) == alone
    True
    """
    temperature = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)[:, None]
    greedy = temperature == 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)
    uniform = [
        torch.rand((1,), generator=g, device=logits.device) if t else torch.zeros(1, device=logits.device)
        for t, g in zip(temperatures, generators)
    ]  # a greedy row draws nothing, as alone
    return torch.where(greedy[:, 0], scaled.argmax(dim=-1), inverse_cdf(scaled, torch.stack(uniform))).tolist()


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int = 64,
    params: SamplingParams = GREEDY,
    stop_ids: list[int] | tuple[int, ...] = (),
    seed: int = 0,
) -> list[int]:
    """New token ids after `prompt_ids`, ending at the first stop token (included) or the budget."""
    assert max_new_tokens > 0, f"max_new_tokens must be > 0, got {max_new_tokens}"
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    context = model_max_seq_len(model) or 1 << 30
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = forward_logits(model, {"input_ids": ids[:, -context:]})[:, -1, :]  # (1, V)
        token = sample_next_token(logits, params, generator)
        new.append(int(token))
        if new[-1] in stop_ids:
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
    model.train(was_training)
    return new
