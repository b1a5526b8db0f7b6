"""One home for evaluation: what the trainers, `tierlm eval` and the speedrun measure on held-out data.

- **Validation loss and bits per byte** (`validation_totals`): a strategy's summable metrics over the fixed eval
  batches, shared by the ranks; the `Trainer` evaluates with it (pretraining, SFT, DPO, reward models).
- **pass@1 / pass@k** (`evaluate_pass_at_k`): k samples of each held-out problem or episode, scored by the task's
  reward; the RL loop and `tierlm eval --checkpoint` evaluate with it.
- **CORE** (`evaluate_core`): DCLM's in-context tasks scored by log-likelihood, as nanochat reports for base models;
  `tierlm eval --core`.

lm-evaluation-harness's tasks (`tierlm eval --harness`) run through its own evaluator, tierlm's model wrapped as its
`TemplateLM` (`tierlm.commands.harness`).

## CORE

CORE (DCLM, Li et al., 2024; the base-model score nanochat reports): in-context tasks scored by the model's
log-likelihood, each accuracy centred on its random baseline, CORE their mean.

It reads an eval bundle folder in DCLM's / nanochat's layout: `core.yaml` (`icl_tasks`: label, dataset_uri,
num_fewshot, icl_task_type, continuation_delimiter), `eval_data/<dataset_uri>` (JSONL items) and
`eval_meta_data.csv` (`Eval Task`, `Random baseline` in percent). The task types:

- multiple_choice — `query`, `choices`, `gold`: the choice with the lowest mean loss over its tokens;
- schema — `context_options`, `continuation`, `gold`: the context under which the shared continuation has the
  lowest mean loss;
- language_modeling — `context`, `continuation`: right when greedy decoding reproduces the continuation.

Few-shot examples are drawn per item with `random.Random(1234 + index)` from the other items, and laid out, as nanochat
does; every prompt starts with the tokenizer's BOS. centred = (accuracy - baseline) / (1 - baseline).
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import yaml

from tierlm.errors import ConfigError, DataError
from tierlm.loops.sampling import RolloutSampler
from tierlm.models import forward_logits, model_max_seq_len
from tierlm.tasks import Environment, Task


# -- validation loss ----------------------------------------------------------------------------
def validation_totals(backend, strategy, eval_set: list, data_rank: int = 0, data_world: int = 1) -> dict:
    """The summed `strategy.compute_metrics` of `eval_set`'s batches, over every rank (the result does not depend on
    the world size): ranks share the batches, and every rank runs the same number of forwards (a rank short of
    batches repeats one with weight 0), as FSDP's collectives require. `strategy.summarize` turns it into figures."""
    totals: dict[str, float] = defaultdict(float)
    mine = eval_set[data_rank::data_world]
    for i in range(-(-len(eval_set) // data_world)):
        batch, weight = (mine[i], 1.0) if i < len(mine) else (eval_set[0], 0.0)
        out = backend.forward(strategy.prepare_batch(batch), strategy.compute_metrics).wait()
        for key, value in out.items():
            totals[key] += weight * value
    return backend.all_reduce_sums(dict(totals)) if backend.world_size > 1 else dict(totals)


# -- pass@k -------------------------------------------------------------------------------------
def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021): 1 - C(n-c, k) / C(n, k).

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 4), pass_at_k(4, 0, 4)
    (0.25, 1.0, 0.0)
    """
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate_pass_at_k(
    sampler: RolloutSampler,
    task: Task | Environment,
    rank: int = 0,
    world_size: int = 1,
    sum_over_ranks: Callable[[dict], dict] | None = None,
) -> dict[str, float]:
    """pass@1 and pass@k over the first `rl.eval_problems` held-out problems (or episodes), `rl.eval_k` samples each
    at `rl.eval_temperature`; the ranks share the problems (`sum_over_ranks` adds their sums). A sample is right
    with full marks (every turn right, for episodes). Each problem's randomness is its own, the same at every
    evaluation."""
    rl = sampler.rl
    k, n = rl.eval_k, min(rl.eval_problems, len(task))
    indices = list(range(rank, n, world_size))
    generators = [sampler.generator(-1, index) for index in indices]
    p1 = pk = reward = tool = 0.0
    for group in sampler.groups(task, indices, generators, k, rl.eval_temperature):
        correct = sum(r.reward >= 1.0 - 1e-6 for r in group)
        tool += sum(r.completion.tool_calls > 0 for r in group)
        p1, pk = p1 + pass_at_k(k, correct, 1), pk + pass_at_k(k, correct, k)
        reward += sum(r.reward for r in group)
    sums = {"p1": p1, "pk": pk, "reward": reward, "tool": tool}
    sums = sum_over_ranks(sums) if sum_over_ranks is not None else sums
    return {
        "pass@1": sums["p1"] / n,
        "pass@k": sums["pk"] / n,
        "k": k,
        "eval_problems": n,
        "eval_reward_mean": sums["reward"] / (n * k),
        "eval_tool_use": sums["tool"] / (n * k),
    }


# -- CORE ---------------------------------------------------------------------------------------
def _shots(examples: list[str]) -> str:
    """Few-shot examples as nanochat's templates lay them out: each followed by a blank line."""
    return "".join(f"{example}\n\n" for example in examples)


@dataclass
class CoreTask:
    label: str
    kind: str
    num_fewshot: int
    delimiter: str
    baseline: float  # a fraction
    items: list[dict]


def bundle_files(folder: str | Path) -> dict[str, Path]:
    """core.yaml and eval_meta_data.csv of a bundle folder that has its eval_data/ too (else one line)."""
    folder = Path(folder)
    files = {name: folder / name for name in ("core.yaml", "eval_meta_data.csv")}
    for name, path in {**files, "eval_data/": folder / "eval_data"}.items():
        if not path.exists():
            raise ConfigError(f"{folder} is not a CORE eval bundle: no {name} (the layout of nanochat's eval_bundle)")
    return files


def read_bundle(folder: str | Path) -> list[CoreTask]:
    """The tasks of an eval bundle folder (one-line refusals for a missing or malformed part)."""
    folder = Path(folder)
    files = bundle_files(folder)
    with files["eval_meta_data.csv"].open(encoding="utf-8") as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) / 100 for row in csv.DictReader(f)}
    tasks = []
    for entry in yaml.safe_load(files["core.yaml"].read_text(encoding="utf-8")).get("icl_tasks", []):
        label, kind = entry["label"], entry["icl_task_type"]
        if kind not in ("multiple_choice", "schema", "language_modeling"):
            raise DataError(f"{files['core.yaml']}: task {label} has icl_task_type {kind!r}, which CORE does not score")
        if label not in baselines:
            raise DataError(f"{files['eval_meta_data.csv']}: no random baseline for task {label}")
        path = folder / "eval_data" / entry["dataset_uri"]
        items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        fewshot = entry.get("num_fewshot", [0])
        fewshot = fewshot[0] if isinstance(fewshot, list) else fewshot
        tasks.append(CoreTask(label, kind, fewshot, entry.get("continuation_delimiter", " "), baselines[label], items))
    return tasks


def prompts_of(task: CoreTask, index: int) -> list[str]:
    """The prompts one item is scored on: one per choice (multiple choice), one per context (schema), or the
    context alone and with its continuation (language modelling)."""
    item, d = task.items[index], task.delimiter
    shots = []
    if task.num_fewshot:
        others = [i for i in range(len(task.items)) if i != index]
        shots = [task.items[i] for i in random.Random(1234 + index).sample(others, task.num_fewshot)]
    if task.kind == "multiple_choice":
        head = _shots([f"{e['query']}{d}{e['choices'][e['gold']]}" for e in shots])
        return [f"{head}{item['query']}{d}{choice}" for choice in item["choices"]]
    if task.kind == "schema":
        head = _shots([f"{e['context_options'][e['gold']]}{d}{e['continuation']}" for e in shots])
        return [f"{head}{context}{d}{item['continuation']}" for context in item["context_options"]]
    head = _shots([f"{e['context'].strip()}{d}{e['continuation']}" for e in shots])
    without = f"{head}{item['context'].strip()}{d}".strip()
    return [without, f"{head}{item['context'].strip()}{d}{item['continuation']}"]


def _common(sequences: list[list[int]], from_end: bool) -> int:
    n = min(map(len, sequences))
    for i in range(n):
        position = -1 - i if from_end else i
        if any(s[position] != sequences[0][position] for s in sequences):
            return i
    return n


@torch.no_grad()
def score_item(model, tokenizer, task: CoreTask, index: int, device) -> bool:
    """Is the model right on one item?"""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    tokens = [bos + tokenizer.encode(p) for p in prompts_of(task, index)]
    if task.kind == "language_modeling":
        start = len(tokens[0])
        assert tokens[1][:start] == tokens[0], "a context's tokens must prefix its context + continuation's"
        tokens, spans = tokens[1:], [(start, len(tokens[1]))]
    elif task.kind == "multiple_choice":
        start = _common(tokens, from_end=False)
        spans = [(start, len(t)) for t in tokens]
    else:
        shared = _common(tokens, from_end=True)
        spans = [(len(t) - shared, len(t)) for t in tokens]
    limit = model_max_seq_len(model)
    if limit is not None:  # keep the last `limit` tokens of a longer sequence (its span shifts with them)
        cut = [max(len(t) - limit, 0) for t in tokens]
        tokens = [t[c:] for t, c in zip(tokens, cut)]
        spans = [(s - c, e - c) for (s, e), c in zip(spans, cut)]
    width = max(map(len, tokens))
    ids = torch.full((len(tokens), width), tokenizer.pad_id, dtype=torch.long)
    for row, t in enumerate(tokens):
        ids[row, : len(t)] = torch.tensor(t)
    logits = forward_logits(model, {"input_ids": ids.to(device)}).float()
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten().to(device), reduction="none")
    losses = losses.view(len(tokens), width - 1)
    if task.kind == "language_modeling":
        (start, end), predicted = spans[0], logits[0, :-1].argmax(-1)
        return bool(torch.equal(predicted[start - 1 : end - 1].cpu(), ids[0, start:end]))
    means = [float(losses[row, s - 1 : e - 1].mean()) for row, (s, e) in enumerate(spans)]
    return means.index(min(means)) == task.items[index]["gold"]


def evaluate_core(
    model,
    tokenizer,
    bundle: str | Path | list[CoreTask],
    max_per_task: int | None = None,
    device="cpu",
    rank: int = 0,
    world_size: int = 1,
    sum_over_ranks: Callable[[dict], dict] | None = None,
) -> dict:
    """{"tasks": {label: {"accuracy", "centered", "items"}}, "core": the mean centred accuracy}. `bundle`: its folder
    or its tasks (`read_bundle`). The ranks share the items (`sum_over_ranks` adds their counts), each running the
    same number of forwards (a rank short of items scores item 0 again and drops it), as FSDP's collectives
    require; the model is left in the mode it was in."""
    tasks = read_bundle(bundle) if isinstance(bundle, (str, Path)) else bundle
    sizes = {
        task.label: len(task.items) if max_per_task is None else min(max_per_task, len(task.items)) for task in tasks
    }
    training, counts = model.training, {}
    model.eval()
    for task in tasks:
        n = sizes[task.label]
        mine = range(rank, n, world_size)
        scored = [score_item(model, tokenizer, task, mine[i] if i < len(mine) else 0, device)
                  for i in range(-(-n // world_size))]  # fmt: skip
        counts[task.label] = float(sum(scored[: len(mine)]))
    model.train(training)
    counts = sum_over_ranks(counts) if sum_over_ranks is not None and world_size > 1 else counts
    results = {}
    for task in tasks:
        n = sizes[task.label]
        accuracy = counts[task.label] / max(n, 1)
        results[task.label] = {
            "accuracy": accuracy,
            "centered": (accuracy - task.baseline) / (1 - task.baseline),
            "items": n,
        }
    return {"tasks": results, "core": sum(r["centered"] for r in results.values()) / max(len(results), 1)}


@dataclass
class CoreSchedule:
    """CORE measured during training (training.core_bundle), as nanochat's base training measures it: the bundle
    read once, CORE every `every` steps (0: none between) and at step `last`.

    >>> schedule = CoreSchedule(tasks=[], tokenizer=None, max_per_task=500, every=20, last=50)
    >>> [step for step in range(1, 51) if schedule.due(step)]
    [20, 40, 50]
    """

    tasks: list[CoreTask]
    tokenizer: object
    max_per_task: int | None
    every: int
    last: int

    @classmethod
    def of(cls, training, tokenizer) -> "CoreSchedule | None":
        """From the training config (None without a bundle); a bundle that cannot be read is a one-line refusal."""
        if training.core_bundle is None:
            return None
        tasks = read_bundle(training.core_bundle)
        return cls(tasks, tokenizer, training.core_max_per_task, training.core_steps, training.num_train_steps)

    def due(self, step: int) -> bool:
        return step == self.last or (self.every > 0 and step % self.every == 0)

    def measure(self, backend, data_rank: int, data_world: int) -> dict:
        """CORE of the backend's model, the items shared by the data-parallel ranks."""
        sums = backend.all_reduce_sums if backend.world_size > 1 else None
        model, device = backend.eval_model, backend.device
        return evaluate_core(model, self.tokenizer, self.tasks, self.max_per_task, device, data_rank, data_world, sums)
