"""Tier 3: plots and report cards from run directories (their metrics.jsonl), with matplotlib."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tierlm.errors import ConfigError


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
        raise ConfigError("plots need matplotlib: pip install 'tierlm[report]'") from None
    return plt


def plot_series(path: Path, title: str, x_label: str, series: dict[str, tuple[list[float], list[float]]], y_label: str = "",
                log_x: bool = False) -> Path | None:
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def val_loss_curve(records: list[dict]) -> list[tuple[float, float]]:
    """(tokens seen, val loss) of each eval line; lines from before eval lines carried `tokens_seen`
    are placed at step x the run's tokens per step."""
    last = next((r for r in reversed(records) if r.get("type") == "train" and r.get("step")), None)
    per_step = last["tokens_seen"] / last["step"] if last else 0
    return [(r.get("tokens_seen", r["step"] * per_step), r["val_loss"]) for r in records if r.get("type") == "eval" and "val_loss" in r]


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
        written.append(plot_series(out_dir / f"{name}_reward.png", f"{name}: reward and pass@k", "step", {
            "train reward": _xy(records, "train", "step", "reward_mean"),
            "held-out pass@1": _xy(records, "eval", "step", "pass@1"),
            "held-out pass@k": _xy(records, "eval", "step", "pass@k"),
        }))
    elif train:
        val = val_loss_curve(records)
        written.append(plot_series(out_dir / f"{name}_loss.png", f"{name}: loss", "tokens", {
            "train (EMA)": _xy(records, "train", "tokens_seen", "loss_ema" if "loss_ema" in train[-1] else "loss"),
            "validation": ([v[0] for v in val], [v[1] for v in val]),
        }, "cross-entropy (nats/token)"))
    return [p for p in written if p is not None]


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
    figures: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters()),
                               "weight_zeros": sum(int((p == 0).sum()) for p in matrices) / max(1, sum(p.numel() for p in matrices))}
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
