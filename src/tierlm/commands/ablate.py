"""Tier 3: ablations you can trust — `tierlm ablate` and `AblationCoordinator`.

    tierlm ablate --config gpt2-shakespeare-char --variants V0,V1,V3 --seeds 0,1,2 [section.key=value ...]
    tierlm ablate --config gpt2-shakespeare-char --variant spam:training.optimizer=adamw_spam --variant ...
    tierlm ablate --report runs/ablate_gpt2-shakespeare-char

A variant is a V-step (`V3`: model.variant=V3) or a named set of overrides (`name:key=value,key=value`).
Every variant x seed is its own run directory (`<out>/<variant>_seed<k>`) trained in its own process
(`tierlm.commands.child`: forked from a server that imported torch and tierlm once; its output in
`<out>/<variant>_seed<k>.log`) from the same base config: the same seed (so the same initial draw and
data order) per replicate and the same token budget for all — a variant that would change the steps or
the batch is refused before anything runs (the defect of the code base: wall-clock budgets gave
variants different step counts).
Before the first run, every variant's config is built and checked — its overrides read by the stage, its
model described on the meta device, its data opened — so a typo is one line, not a table of failures
found hours later. A run that fails once running is recorded with its error and the others go on; the
command then exits 1, its last line naming the first failure. Re-running continues unfinished runs
(they resume exactly from their checkpoints) and skips finished ones. Under torchrun every rank runs
the variants one after another in this process (each variant on all ranks).

Results: `results.json` (every run), `summary.md` (per variant: final and best val loss and perplexity
as mean +- std over seeds, the difference to the first variant with a 95% interval paired by seed,
parameters, tokens/s, peak memory, steps, and for pruned runs sparsity and inference latency), and
plots (val loss against tokens; gate statistics over steps for RA variants).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierlm.commands.cli import STAGE_COMMANDS
from tierlm.commands.options import Command, add_config_args, int_list
from tierlm.commands.overrides import check_stage_overrides, override_key
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError, TierlmError

SPEC_FILE = "ablation.json"
# Two-sided 95% Student t quantiles by degrees of freedom (1..30); beyond, the normal's 1.96.
T95 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]
BUDGET_KEYS = (
    "training.num_train_steps",
    "training.per_device_train_batch_size",
    "training.gradient_accumulation_steps",
    "training.total_batch_size",
    "training.target_param_data_ratio",
    "data.max_seq_length",
    "training.seed",
)

PLACED = {
    "infra.output_dir": "the ablation folder is --out (each run trains in <out>/<variant>_seed<k>)",
    "training.seed": "each replicate's seed comes from --seeds (or ablation.seeds)",
}


class RunsFailed(TierlmError):
    """Some runs of an ablation failed (the others' results are written)."""

    exit_code = 1


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]


def parse_variant(spec: str) -> Variant:
    """A V-step or `name:key=value,key=value`.

    >>> parse_variant("V3"), parse_variant("spam:training.optimizer=adamw_spam,training.spam_theta=50")
    (Variant(name='V3', overrides=('model.variant=V3',)), Variant(name='spam',
    overrides=('training.optimizer=adamw_spam', 'training.spam_theta=50')))
    """
    spec = spec.strip()
    if ":" not in spec:
        if not spec or spec[0] not in "vV" or not spec[1:].isdigit():
            raise ConfigError(f"variant {spec!r} is neither a V-step (V0-V19) nor name:key=value,key=value")
        return Variant(spec.upper(), (f"model.variant={spec.upper()}",))
    name, _, body = spec.partition(":")
    items = tuple(item.strip() for item in body.split(",") if item.strip())
    if (
        not name
        or not name.replace("-", "").replace("_", "").isalnum()
        or not items
        or any("=" not in i for i in items)
    ):
        raise ConfigError(
            f"variant {spec!r} must look like name:section.key=value[,section.key=value] (name: letters, digits, - and "
            f"_)"
        )
    return Variant(name, items)


def _t95(df: int) -> float:
    return T95[df - 1] if 1 <= df <= len(T95) else 1.96


def paired_difference(values: list[float], baseline: list[float]) -> tuple[float, float | None]:
    """(mean difference, half-width of its 95% interval) of paired replicates; None with one pair.

    >>> paired_difference([2.0, 2.2, 2.1], [2.0, 2.0, 2.0])
    (0.1000..., 0.2484...)
    """
    diffs = [v - b for v, b in zip(values, baseline)]
    mean = statistics.mean(diffs)
    if len(diffs) < 2:
        return mean, None
    return mean, _t95(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))


@dataclass
class AblationCoordinator:
    """Run `variants` x `seeds` of one base config (a YAML file or a preset) under `out`."""

    config: str
    variants: list[Variant]
    seeds: list[int] = field(default_factory=lambda: [0])
    overrides: list[str] = field(default_factory=list)
    out: Path | None = None
    stage: str = "pretrain"

    def __post_init__(self) -> None:
        if not self.variants:
            raise ConfigError("an ablation needs at least one variant (--variants V0,V1 or --variant name:key=value)")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ConfigError(f"variant names must differ, got {', '.join(names)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ConfigError(f"--seeds must be distinct whole numbers >= 0, got {self.seeds}")
        self.out = Path(self.out or f"runs/ablate_{Path(self.config).stem}")

    # -- planning --------------------------------------------------------------------------
    def run_overrides(self, variant: Variant, seed: int) -> list[str]:
        """The command's overrides, the variant's, and the run's seed and directory."""
        return [
            *self.overrides,
            *variant.overrides,
            f"training.seed={seed}",
            f"infra.output_dir={self.run_dir(variant, seed)}",
        ]

    def run_config(self, variant: Variant, seed: int) -> TierlmConfig:
        return TierlmConfig.load(self.config, self.run_overrides(variant, seed))

    def run_dir(self, variant: Variant, seed: int) -> Path:
        return self.out / f"{variant.name}_seed{seed}"

    def check(self) -> None:
        """Refuse, before anything runs, a variant that would fail to start or would not compare: its config
        invalid, an override it would not read, a model it cannot build (described on the meta device), data
        that does not open, or a different token budget."""
        from tierlm.builders.model import describe_model
        from tierlm.builders.tokenizer import pretrained_location
        from tierlm.stages import STAGES

        stage, opened = STAGES[self.stage], set()
        if not stage.token_rows:  # its batches count no tokens to hold equal
            raise ConfigError(f"tierlm ablate compares runs at equal tokens: --stage pretrain or sft, not {self.stage}")
        for variant in self.variants:
            bad = [key for key in map(override_key, variant.overrides) if key in BUDGET_KEYS]
            if bad:
                raise ConfigError(
                    f"variant {variant.name} sets {', '.join(bad)}: every variant trains on the same data "
                    "order and token budget; put those in the base config or the command's overrides"
                )
            config = self.run_config(variant, self.seeds[0])  # validates
            overrides = [*self.overrides, *variant.overrides]
            try:
                check_stage_overrides("ablate", stage, config, overrides, sections=("ablation",), placed=PLACED)
                describe_model(config, config.tokenizer.vocab_size, pretrained_location(config))
                data = json.dumps(config.data.model_dump(mode="json"), sort_keys=True)
                if data not in opened:  # each variant's data, opened once
                    open_data(config, stage)
                    opened.add(data)
            except TierlmError as error:
                raise type(error)(f"variant {variant.name}: {error}") from None

    # -- running ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train every unfinished run (failures recorded, not raised), then write the results."""
        self.check()
        main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun every rank trains; rank 0 writes the records
        self.out.mkdir(parents=True, exist_ok=True)
        if main_rank:
            (self.out / SPEC_FILE).write_text(
                json.dumps(
                    {
                        "config": self.config,
                        "stage": self.stage,
                        "seeds": self.seeds,
                        "overrides": self.overrides,
                        "variants": [{"name": v.name, "overrides": list(v.overrides)} for v in self.variants],
                    },
                    indent=1,
                )
                + "\n"
            )
        for variant in self.variants:
            for seed in self.seeds:
                run_dir = self.run_dir(variant, seed)
                if (run_dir / "model").is_dir():
                    continue  # finished earlier: untouched
                print(f"== ablation: {variant.name}, seed {seed} -> {run_dir}", flush=True)
                error = self._train(variant, seed)
                status = {"error": error, "finished_at": time.time()} if error else {"finished_at": time.time()}
                if error:
                    print(f"   failed: {error}", flush=True)
                if main_rank:
                    run_dir.mkdir(parents=True, exist_ok=True)
                    (run_dir / "ablation_status.json").write_text(json.dumps(status) + "\n")
        results = write_results(self.out) if main_rank else {}
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from tierlm.primitives.parallel import shutdown_distributed

            shutdown_distributed()
        return results

    def failures(self, results: dict[str, Any]) -> None:
        """Raise `RunsFailed` naming the first failed run, when any failed (after the results are written)."""
        failed = [(v, s, r["error"]) for v, runs in results.items() for s, r in runs.items() if r.get("error")]
        if failed:
            total = sum(len(runs) for runs in results.values())
            variant, seed, error = failed[0]
            raise RunsFailed(
                f"{len(failed)} of {total} ablation runs failed (the others' results are in "
                f"{self.out / 'summary.md'}); first, {variant} seed {seed}: {error}"
            )

    def _train(self, variant: Variant, seed: int) -> str | None:
        """One run: in this process under torchrun (all ranks together), else in a child process."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from tierlm.stages import run_stage

            try:  # the variants share this job's process group
                run_stage(self.run_config(variant, seed), self.stage, leave_group=False)
            except TierlmError as error:
                print(f"tierlm: error: [rank {os.environ.get('RANK', '0')}] {error}", file=sys.stderr, flush=True)
                return "the run failed (see its rank's error above)"
            return None
        from tierlm.commands.child import run_command

        log = self.out / f"{variant.name}_seed{seed}.log"  # beside the run's folder, which must start empty
        start = log.stat().st_size if log.is_file() else 0  # a resumed run appends to its log
        code = run_command([self.stage, "--config", self.config, *self.run_overrides(variant, seed)], log)
        if code == 0:
            return None
        with open(log, "rb") as f:
            f.seek(start)
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("tierlm: error:")]
        return (errors or lines or [f"exit code {code}"])[-1].removeprefix("tierlm: error: ")[:500]


def open_data(config: TierlmConfig, stage) -> None:
    """Open the data a run of `stage` reads (a refusal names what is wrong); a stream is read as it goes."""
    from tierlm.builders.loaders import open_splits

    if not (config.data.stream or config.data.streaming):
        open_splits(config, stage.example_kind, None)


# -- results ------------------------------------------------------------------------------------
def run_result(run_dir: Path) -> dict[str, Any]:
    """The figures of one run from its directory (metrics.jsonl, the model folder, its status)."""
    from tierlm.metrics.report import model_figures, read_metrics

    records = read_metrics(run_dir)
    status = (
        json.loads((run_dir / "ablation_status.json").read_text())
        if (run_dir / "ablation_status.json").is_file()
        else {}
    )
    train = [r for r in records if r.get("type") == "train"]
    evals = [r for r in records if r.get("type") == "eval" and "val_loss" in r]
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "finished": (run_dir / "model").is_dir(),
        "error": status.get("error"),
    }
    if evals:
        final, best = evals[-1]["val_loss"], min(r["val_loss"] for r in evals)
        out.update(
            final_val_loss=final,
            best_val_loss=best,
            final_ppl=math.exp(min(final, 50)),
            best_ppl=math.exp(min(best, 50)),
        )
    if train:
        late = train[len(train) // 2 :]
        out.update(
            steps=train[-1]["step"],
            tokens=train[-1]["tokens_seen"],
            tokens_per_sec=statistics.mean(r["tokens_per_sec"] for r in late),
            peak_rss_mb=max((r.get("rss_mb", 0.0) for r in train), default=0.0),
        )
        if "sparsity" in train[-1]:
            out["sparsity"] = train[-1]["sparsity"]
    if out["finished"]:
        out.update(model_figures(run_dir / "model"))
    return out


def _mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    spread = f" +- {statistics.stdev(values):.4f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.4f}{spread}"


def write_results(out: Path) -> dict[str, Any]:
    """results.json, summary.md and plots/ from the run directories under `out` (`tierlm ablate --report`)."""
    out = Path(out)
    if not (out / SPEC_FILE).is_file():
        raise ConfigError(f"{out} holds no ablation ({SPEC_FILE} is missing); run tierlm ablate first")
    spec = json.loads((out / SPEC_FILE).read_text())
    seeds, variants = spec["seeds"], spec["variants"]
    results = {v["name"]: {str(s): run_result(out / f"{v['name']}_seed{s}") for s in seeds} for v in variants}
    (out / "results.json").write_text(json.dumps({"spec": spec, "runs": results}, indent=1) + "\n")
    (out / "summary.md").write_text(summary_markdown(spec, results, _plots(out, spec, results)))
    return results


def summary_markdown(spec: dict, results: dict[str, dict[str, dict]], plots: list[Path]) -> str:
    base_name = spec["variants"][0]["name"]
    base = results[base_name]
    lines = [
        f"# Ablation: {spec['config']} ({spec['stage']})",
        "",
        f"Variants x seeds {spec['seeds']}, the same data order, seed per replicate and token budget; overrides: "
        f"{' '.join(spec['overrides']) or 'none'}. Δ is against {base_name}, paired by seed, with a 95% t interval.",
        "",
        "| variant | runs | final val loss | best val loss | final ppl | Δ final val loss vs "
        + base_name
        + " | parameters | tokens/s | peak RSS MB | steps | tokens | sparsity | latency p50/p95 ms (T=64; T=256) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    failures = []
    for v in spec["variants"]:
        runs = results[v["name"]]
        done = {s: r for s, r in runs.items() if r.get("finished") and "final_val_loss" in r}
        failures += [f"- {v['name']} seed {s}: {r['error']}" for s, r in runs.items() if r.get("error")]
        paired = [s for s in done if s in base and base[s].get("finished") and "final_val_loss" in base[s]]
        delta = "n/a"
        if v["name"] != base_name and paired:
            mean, half = paired_difference(
                [done[s]["final_val_loss"] for s in paired], [base[s]["final_val_loss"] for s in paired]
            )
            delta = f"{mean:+.4f}" + (
                f" [{mean - half:+.4f}, {mean + half:+.4f}]" if half is not None else " (one seed)"
            )
        one = next(iter(done.values()), {})
        latency = (
            (
                f"{one['latency_ms_p50_T64']:.2f}/{one['latency_ms_p95_T64']:.2f}; {one['latency_ms_p50_T256']:.2f}/"
                f"{one['latency_ms_p95_T256']:.2f}"
            )
            if "latency_ms_p50_T256" in one
            else "n/a"
        )
        col = lambda key: [r[key] for r in done.values() if key in r]  # noqa: E731
        lines.append(
            " | ".join(
                [
                    f"| {v['name']}",
                    f"{len(done)}/{len(runs)}",
                    _mean_std(col("final_val_loss")),
                    _mean_std(col("best_val_loss")),
                    _mean_std(col("final_ppl")),
                    delta,
                    f"{one.get('parameters', 0):,}",
                    f"{statistics.mean(col('tokens_per_sec')):,.0f}" if col("tokens_per_sec") else "n/a",
                    f"{max(col('peak_rss_mb'), default=0):.0f}",
                    str(one.get("steps", "n/a")),
                    f"{one.get('tokens', 0):,}",
                    f"{statistics.mean(col('sparsity')):.3f}" if col("sparsity") else "-",
                    latency,
                ]
            )
            + " |"
        )
    if failures:
        lines += ["", "## Failed runs", "", *failures]
    lines += ["", "## Plots", "", *[f"![{p.stem}](plots/{p.name})" for p in plots], ""]
    return "\n".join(lines)


def _plots(out: Path, spec: dict, results: dict[str, dict[str, dict]]) -> list[Path]:
    from tierlm.metrics.report import plot_series, read_metrics, val_loss_curve

    curves, gates = {}, {}
    for v in spec["variants"]:
        by_tokens: dict[float, list[float]] = {}
        gate_steps: dict[int, list[float]] = {}
        for seed in spec["seeds"]:
            records = read_metrics(out / f"{v['name']}_seed{seed}")
            for tokens, loss in val_loss_curve(records):
                by_tokens.setdefault(tokens, []).append(loss)
            for r in records:
                if r.get("type") == "train" and "ra_w_rec_mean" in r:
                    gate_steps.setdefault(r["step"], []).append(r["ra_w_rec_mean"])
        xs = sorted(by_tokens)
        curves[v["name"]] = (xs, [statistics.mean(by_tokens[x]) for x in xs])
        if gate_steps:
            steps = sorted(gate_steps)
            gates[v["name"]] = (steps, [statistics.mean(gate_steps[s]) for s in steps])
    plots = [
        plot_series(out / "plots" / "val_loss.png", "validation loss (mean over seeds)", "tokens", curves, "val loss"),
        plot_series(out / "plots" / "ra_gates.png", "Unified RA: mean reciprocal gate w_rec", "step", gates, "w_rec"),
    ]
    return [p for p in plots if p is not None]


# -- the command ----------------------------------------------------------------------------
def arguments(ablate: argparse.ArgumentParser) -> None:
    add_config_args(ablate, required=False)
    ablate.add_argument(
        "--variants", default=None, help="comma-separated V-steps, e.g. V0,V1,V3 (the first is the baseline)"
    )
    ablate.add_argument(
        "--variant", action="append", default=[], help="name:section.key=value[,section.key=value] (repeatable)"
    )
    ablate.add_argument(
        "--seeds", type=int_list, default=None, help="comma-separated seeds, one replicate each (default: the config's)"
    )
    ablate.add_argument("--out", default=None, help="ablation folder (default runs/ablate_<config name>)")
    ablate.add_argument(
        "--stage", choices=STAGE_COMMANDS, default="pretrain", help="a stage whose batches are rows of tokens"
    )
    ablate.add_argument(
        "--report", default=None, metavar="DIR", help="only rebuild results.json, summary.md and plots of DIR"
    )


def run(args: argparse.Namespace) -> None:
    if args.report:
        write_results(Path(args.report))
        print(f"summary: {Path(args.report) / 'summary.md'}")
        return
    if not args.config:
        raise TierlmError("tierlm ablate needs --config (a YAML file or a preset), or --report DIR")
    base = TierlmConfig.load(args.config, args.overrides)
    given = {override_key(o) for o in args.overrides}
    for key, flag, value in (
        ("ablation.variants", "--variants", args.variants or args.variant),
        ("ablation.seeds", "--seeds", args.seeds),
    ):
        if key in given and value:
            raise ConfigError(f"{key} and its flag ({flag}) both given: keep one")
    specs = [v for v in (args.variants or "").split(",") if v.strip()] + args.variant or base.ablation.variants
    seeds = args.seeds or base.ablation.seeds
    coordinator = AblationCoordinator(
        args.config, [parse_variant(v) for v in specs], seeds, list(args.overrides), args.out, args.stage
    )
    results = coordinator.run()
    print(f"summary: {coordinator.out / 'summary.md'}")
    coordinator.failures(results)  # an ablation with failed runs exits 1, the first failure its last line


COMMAND = Command(arguments, run)
