"""Metric sinks: JSONL always; TensorBoard, Weights & Biases and MLflow when asked for.

A resumed run continues each sink's own record of the run rather than starting another: metrics.jsonl
drops its lines after the checkpoint, TensorBoard purges its events from the step after it
(`purge_step`), W&B resumes the run whose id the run directory keeps (`resume="allow"`; the replayed
steps are W&B's to ignore), MLflow continues the run whose id the run directory keeps and skips the
steps it already holds (the replay computes the same values).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from tierlm.errors import ConfigError

PER_ITEM = ("rollout",)
"""Records of one item each, several a step (rl.log_rollouts' rollouts): metrics.jsonl and W&B keep them; the scalar
dashboards (TensorBoard, MLflow), whose series hold one value a step, leave them out."""


class JSONLSink:
    """One JSON object per line in `<output_dir>/metrics.jsonl`; flushed every write."""

    def __init__(self, path: str | Path, resume_from_step: int | None = None):
        self.path = Path(path)
        if resume_from_step is not None and self.path.exists():
            self._truncate_after(resume_from_step)
        self._file = open(self.path, "a")

    def _truncate_after(self, step: int) -> None:
        """Drop lines logged after the checkpoint being resumed: the run repeats those steps. A line
        that is not a JSON object (the last one, cut short by a kill mid-write) is dropped with a warning."""
        kept, broken = [], 0
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                record = None
            if not isinstance(record, dict):
                broken += bool(line.strip())
                continue
            if record.get("step", 0) <= step:
                kept.append(line)
        if broken:
            print(
                f"tierlm: warning: {self.path}: ignored {broken} unreadable line(s) (a write cut short)",
                file=sys.stderr,
            )
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: str | Path, resume_from_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(
                "report_to includes 'tensorboard' but it is not installed: pip install 'tierlm[tensorboard]'"
            ) from e
        # Resuming: the events of the steps after the checkpoint are purged (they are about to be logged again).
        self.writer = SummaryWriter(
            str(log_dir), purge_step=resume_from_step + 1 if resume_from_step is not None else None
        )

    def log(self, record: dict[str, Any]) -> None:
        prefix, step = record.get("type", "train"), record.get("step", 0)
        if prefix in PER_ITEM:
            return
        for key, value in record.items():
            if key not in ("type", "step") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _kept_id(path: Path, new: Any) -> str:
    """The run id kept in `path`, or a new one (`new()`) written there."""
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = str(new())
    path.write_text(run_id + "\n")
    return run_id


class WandbSink:
    """A W&B run whose id is kept in the run directory (`wandb_run_id`): a resumed run continues it."""

    def __init__(
        self, project: str, run_name: str | None, config: dict[str, Any], output_dir: Path, entity: str | None = None
    ):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError("report_to includes 'wandb' but it is not installed: pip install 'tierlm[wandb]'") from e
        run_id = _kept_id(Path(output_dir) / "wandb_run_id", lambda: uuid.uuid4().hex[:12])  # W&B ids: [a-z0-9]
        self.run = wandb.init(
            project=project, entity=entity, name=run_name, config=config, dir=str(output_dir), id=run_id, resume="allow"
        )

    def log(self, record: dict[str, Any]) -> None:
        prefix = record.get("type", "train")
        self.run.log(
            {f"{prefix}/{k}": v for k, v in record.items() if k not in ("type", "step")}, step=record.get("step")
        )

    def close(self) -> None:
        self.run.finish()


class MLflowSink:
    """An MLflow run (tracking URI: `MLFLOW_TRACKING_URI`, else a store in `<output_dir>/mlruns`) whose id
    is kept in the run directory (`mlflow_run_id`); a resumed run continues it, skipping steps it holds."""

    def __init__(self, output_dir: Path, experiment: str, run_name: str | None, config: dict[str, Any]):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ConfigError(
                "report_to includes 'mlflow' but it is not installed: pip install 'tierlm[mlflow]'"
            ) from e

        output_dir = Path(output_dir)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a file store in the run directory (MLflow 3 keeps it working behind this switch)
            uri = (output_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        id_file = output_dir / "mlflow_run_id"
        if id_file.is_file() and id_file.read_text().strip():
            self.run_id = id_file.read_text().strip()
            histories = [
                self.client.get_metric_history(self.run_id, key)
                for key in ("train/loss", "eval/val_loss", "train/reward_mean")
            ]
            self.logged_step = max((m.step for history in histories for m in history), default=-1)
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            id_file.write_text(self.run_id + "\n")
            self.logged_step = -1
            flat = {k: str(v)[:500] for k, v in _flatten(config).items()}
            for start in range(0, len(flat), 100):  # MLflow takes at most 100 params a call
                self.client.log_batch(
                    self.run_id, params=[_param(k, v) for k, v in list(flat.items())[start : start + 100]]
                )

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(record.get("step", 0))
        if record.get("type") in PER_ITEM:
            return
        if step <= self.logged_step and record.get("type") in ("train", "eval"):
            return  # replayed after a resume: MLflow already holds this step
        now = int(1000 * time.time())
        prefix = record.get("type", "train")
        metrics = [
            Metric(f"{prefix}/{k}", float(v), now, step)
            for k, v in record.items()
            if k not in ("type", "step")
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _param(key: str, value: str):
    from mlflow.entities import Param

    return Param(key, value)


class MetricsLogger:
    """Fans each record out to every sink."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
