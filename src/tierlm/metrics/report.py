"""Tier 3: plots and reports from run directories (their metrics.jsonl), with matplotlib.

Every run writes `report.md` and `plots/*.png` into its directory (`ReportSink`: refreshed at each
evaluation and when the loop ends) unless `TIERLM_REPORT=off` (`reports_on`); `tierlm report RUN_DIR` rebuilds one,
`tierlm report A B --out DIR` overlays several runs in one set of plots.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from tierlm.errors import ConfigError, DataError
from tierlm.metrics.panels import PANELS


def run_of(location: Path | str) -> Path | None:
    """The run directory a model location is the final model of (`RUN/model` beside its metrics.jsonl), or None."""
    return (
        location.parent
        if isinstance(location, Path) and location.name == "model" and (location.parent / "metrics.jsonl").is_file()
        else None
    )


def reports_on(environ=os.environ) -> bool:
    """Whether runs draw their report as they go. Drawing costs about a second each time (matplotlib, ~0.1 s a
    plot): a sweep of many short runs, or a test suite, sets `TIERLM_REPORT=off` and draws the runs it wants
    afterwards with `tierlm report RUN_DIR` (everything is in metrics.jsonl).

    >>> reports_on({}), reports_on({"TIERLM_REPORT": "off"}), reports_on({"TIERLM_REPORT": "1"})
    (True, False, True)
    """
    return environ.get("TIERLM_REPORT", "on").strip().lower() not in ("off", "0", "false", "no", "none")


def record_evaluation(run_dir: Path, record: dict[str, Any], results_file: str, results: Any) -> None:
    """An evaluation of a trained run (`tierlm eval --harness / --core / --chat-core`): `record` becomes a line of its
    metrics.jsonl at the run's last training step (with the tokens it had seen), `results` its `results_file`
    (written whole, then moved into place), and report.md is rebuilt (`reports_on`)."""
    last = next((r for r in reversed(read_metrics(run_dir)) if r.get("type") == "train"), {})
    seen = {"tokens_seen": last["tokens_seen"]} if "tokens_seen" in last else {}
    line = {"type": record["type"], "step": last.get("step", 0), **seen, **record}
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    tmp = run_dir / f".{results_file}.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / results_file)
    if reports_on():
        write_run_report(run_dir)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl (an unreadable line is skipped: a run may be writing it)."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install matplotlib (a tierlm dependency)") from None
    return plt


def plot_series(
    path: Path,
    title: str,
    x_label: str,
    series: dict[str, tuple[list[float], list[float]]],
    y_label: str = "",
    log_x: bool = False,
) -> Path | None:
    """One PNG with a line per named (x, y) series; None (and no file) when every series is empty."""
    series = {name: xy for name, xy in series.items() if xy[0]}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for name, (x, y) in series.items():
        ax.plot(x, y, label=name, marker="o" if len(x) < 12 else None, markersize=3)
    ax.set(title=title, xlabel=x_label, ylabel=y_label)
    if log_x:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.subplots_adjust(left=0.14, right=0.97, top=0.92, bottom=0.13)  # tight_layout drew each figure twice
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def val_loss_curve(records: list[dict]) -> list[tuple[float, float]]:
    """(tokens seen, val loss) of each eval line; lines from before eval lines carried `tokens_seen`
    are placed at step x the run's tokens per step."""
    last = next((r for r in reversed(records) if r.get("type") == "train" and r.get("step")), None)
    per_step = last["tokens_seen"] / last["step"] if last else 0
    return [
        (r.get("tokens_seen", r["step"] * per_step), r["val_loss"])
        for r in records
        if r.get("type") == "eval" and "val_loss" in r
    ]


def _xy(records: list[dict], kind: str, x: str, y: str) -> tuple[list[float], list[float]]:
    rows = [r for r in records if r.get("type") == kind and y in r and x in r]
    return [r[x] for r in rows], [r[y] for r in rows]


def stage_curves(run_dir: Path, out_dir: Path, name: str) -> list[Path]:
    """The curves of one run: training (EMA) and validation loss against tokens for pretraining and
    SFT; reward and pass@k against steps for RL. Returns the PNGs written."""
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("type") == "train"]
    written = []
    if any("reward_mean" in r for r in train):
        written.append(
            plot_series(
                out_dir / f"{name}_reward.png",
                f"{name}: reward and pass@k",
                "step",
                {
                    "train reward": _xy(records, "train", "step", "reward_mean"),
                    "held-out pass@1": _xy(records, "eval", "step", "pass@1"),
                    "held-out pass@k": _xy(records, "eval", "step", "pass@k"),
                },
            )
        )
    elif train:
        val = val_loss_curve(records)
        written.append(
            plot_series(
                out_dir / f"{name}_loss.png",
                f"{name}: loss",
                "tokens",
                {
                    "train (EMA)": _xy(
                        records, "train", "tokens_seen", "loss_ema" if "loss_ema" in train[-1] else "loss"
                    ),
                    "validation": ([v[0] for v in val], [v[1] for v in val]),
                },
                "cross-entropy (nats/token)",
            )
        )
    if any(r.get("type") == "core" for r in records):  # training.core_bundle: the CORE curve
        series = {"CORE": _xy(records, "core", "step", "core")}
        written.append(plot_series(out_dir / f"{name}_core.png", f"{name}: CORE", "step", series, "centred accuracy"))
    return [p for p in written if p is not None]


def hardware() -> str:
    import torch

    device = (
        f"CUDA {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
        if torch.cuda.is_available()
        else "CPU only"
    )
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return f"{machine}, {device}; torch {torch.__version__}, Python {platform.python_version()}"


def git_commit() -> str:
    """The tierlm checkout's commit for a report ("unknown" outside one: `tierlm.source_commit`)."""
    from tierlm.version import source_commit

    return source_commit() or "unknown"


def draw_panels(runs: dict[str, list[dict]], plots: Path) -> list[Path]:
    """The PANELS that have data, one line per (run, series); returns the PNGs written."""
    written = []
    for name, title, x, lines in PANELS:
        series = {}
        for run, records in runs.items():
            for label, kind, key in lines:
                label = f"{run}: {label}" if len(runs) > 1 else label
                series[label] = _xy(
                    records, kind, x, key if key != "loss_ema" or any("loss_ema" in r for r in records) else "loss"
                )
        path = plot_series(plots / f"{name}.png", title, "tokens" if x == "tokens_seen" else x, series)
        if path is not None:
            written.append(path)
    return written


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def harness_table(records: list[dict]) -> list[str]:
    """The report's lines for `tierlm eval --harness` results: each task's latest metrics (none: no lines)."""
    latest: dict[str, tuple[int, dict]] = {}
    for r in records:
        if r.get("type") == "harness":
            latest.update({task: (r.get("step", 0), scores) for task, scores in r.get("tasks", {}).items()})
    if not latest:
        return []
    rows = [
        f"| {task} | {metric} | {_fmt(value)} | {step} |"
        for task, (step, scores) in sorted(latest.items())
        for metric, value in scores.items()
        if not metric.endswith("_stderr")
    ]
    return [
        "## Evaluation harness (lm-evaluation-harness)",
        "",
        "| task | metric | value | step |",
        "|---|---|---|---|",
        *rows,
        "",
    ]


def core_table(records: list[dict], kind: str = "core") -> list[str]:
    """The report's lines for the latest `tierlm eval --core` (or `--chat-core`) result (none: no lines)."""
    latest = next((r for r in reversed(records) if r.get("type") == kind), None)
    if latest is None:
        return []
    rows = [f"| {task} | {_fmt(r['accuracy'])} | {_fmt(r['centered'])} |" for task, r in latest["tasks"].items()]
    return [
        f"## {'ChatCORE' if kind == 'chat_core' else 'CORE'} {_fmt(latest['core'])} (step {latest.get('step', 0)})",
        "",
        "| task | accuracy | centred |",
        "|---|---|---|",
        *rows,
        "",
    ]


def write_run_report(run_dir: Path) -> Path:
    """`report.md` and `plots/*.png` of one run directory, from its metrics.jsonl, run.json and config.yaml."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise DataError(f"{run_dir} has no metrics.jsonl lines: not a tierlm run directory (or nothing was logged yet)")
    plots = draw_panels({run_dir.name: records}, run_dir / "plots")
    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    train = [r for r in records if r.get("type") == "train"]
    evals = [r for r in records if r.get("type") == "eval"]
    last_train, first_eval, last_eval = (
        (train[-1] if train else {}),
        (evals[0] if evals else {}),
        (evals[-1] if evals else {}),
    )
    skip = {"type", "step", "k"}
    lines = [
        f"# tierlm run: {run.get('stage', '?')} — {run_dir.name}",
        "",
        f"- updated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; tierlm commit {git_commit()}",
        f"- hardware: {hardware()}",
        f"- steps: {last_train.get('step', 0)}, elapsed {last_train.get('elapsed_s', 0.0) / 60:.1f} min"
        + (f", {last_train['tokens_seen']:,} tokens" if "tokens_seen" in last_train else ""),
        "",
        "## Evaluation",
        "",
        "| | first (step "
        + str(first_eval.get("step", "-"))
        + ") | last (step "
        + str(last_eval.get("step", "-"))
        + ") |",
        "|---|---|---|",
        *[
            f"| {k} | {_fmt(first_eval.get(k, ''))} | {_fmt(v)} |"
            for k, v in last_eval.items()
            if k not in skip and not isinstance(v, (list, dict))
        ],
        "",
        "## Last training line",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {_fmt(v)} |" for k, v in last_train.items() if k not in skip],
        "",
        *harness_table(records),
        *core_table(records),
        *core_table(records, "chat_core"),
        "## Curves",
        "",
        *[f"![{p.stem}](plots/{p.name})" for p in plots],
        "",
        "## Run",
        "",
        "```json",
        json.dumps({k: v for k, v in run.items() if k != "fingerprint"} | run.get("fingerprint", {}), indent=1),
        "```",
        "",
    ]
    if (run_dir / "config.yaml").is_file():
        lines += ["## Config", "", "```yaml", (run_dir / "config.yaml").read_text().rstrip(), "```", ""]
    report = run_dir / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return report


def overlay_report(run_dirs: list[Path], out: Path) -> Path:
    """One set of plots with every run's lines, and a report.md that lists the runs' last evaluations."""
    runs = {}
    for run_dir in map(Path, run_dirs):
        records = read_metrics(run_dir)
        if not records:
            raise DataError(f"{run_dir} has no metrics.jsonl lines: not a tierlm run directory")
        runs[run_dir.name if run_dir.name not in runs else str(run_dir)] = records
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for the overlaid report")
    plots = draw_panels(runs, out / "plots")
    evals = {
        name: next((r for r in reversed(records) if r.get("type") == "eval"), {}) for name, records in runs.items()
    }
    keys = sorted({k for e in evals.values() for k in e if k not in ("type", "k") and isinstance(e[k], (int, float))})
    lines = [
        f"# tierlm runs compared: {', '.join(runs)}",
        "",
        f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "## Last evaluation",
        "",
        "| run | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
        *[f"| {name} | " + " | ".join(_fmt(e.get(k, "")) for k in keys) + " |" for name, e in evals.items()],
        "",
        "## Curves",
        "",
        *[f"![{p.stem}](plots/{p.name})" for p in plots],
        "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
    return out / "report.md"


class ReportSink:
    """A metrics sink that rewrites the run's report at evaluations (after the first; at most once every
    `min_interval_s`, drawing costs about a second) and when the loop ends. A report that cannot be drawn
    is a warning, never a failed run."""

    def __init__(self, run_dir: Path, min_interval_s: float = 30.0):
        self.run_dir, self.pending, self.min_interval_s = Path(run_dir), False, min_interval_s
        self.last_written = time.monotonic()

    def log(self, record: dict[str, Any]) -> None:
        self.pending = True
        if (
            record.get("type") == "eval"
            and record.get("step")
            and time.monotonic() - self.last_written >= self.min_interval_s
        ):
            self._write()

    def _write(self) -> None:
        try:
            write_run_report(self.run_dir)
            self.pending, self.last_written = False, time.monotonic()
        except (OSError, ValueError, ConfigError, DataError) as e:
            print(f"tierlm: warning: the run report was not written: {e}", file=sys.stderr)

    def close(self) -> None:
        if self.pending:
            self._write()


def model_figures(folder: Path) -> dict[str, Any]:
    """Parameters, the share of exact zeros in the weight matrices, and CPU inference latency
    (p50 / p95 of 20 forwards of one row) at two sequence lengths; cached beside the model."""
    cache = folder.parent / "inference.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    import torch

    from tierlm.models import load_pretrained_model, model_max_seq_len

    model = load_pretrained_model(folder).eval()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    figures: dict[str, Any] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight_zeros": sum(int((p == 0).sum()) for p in matrices) / max(1, sum(p.numel() for p in matrices)),
    }
    longest = model_max_seq_len(model) or 1024
    for length in (min(64, longest), min(256, longest)):
        ids = torch.zeros(1, length, dtype=torch.long)
        times = []
        with torch.no_grad():
            model(ids)  # warm-up
            for _ in range(20):
                start = time.perf_counter()
                model(ids)
                times.append((time.perf_counter() - start) * 1000)
        times.sort()
        figures[f"latency_ms_p50_T{length}"] = times[len(times) // 2]
        figures[f"latency_ms_p95_T{length}"] = times[int(0.95 * (len(times) - 1))]
    cache.write_text(json.dumps(figures) + "\n")
    return figures
