"""Metric sinks: JSONL always; TensorBoard and Weights & Biases when asked for."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tierlm.errors import ConfigError


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
            print(f"tierlm: warning: {self.path}: ignored {broken} unreadable line(s) (a write cut short)", file=sys.stderr)
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
    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError("report_to includes 'tensorboard' but it is not installed: pip install 'tierlm[tensorboard]'") from e
        self.writer = SummaryWriter(str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        prefix, step = record.get("type", "train"), record.get("step", 0)
        for key, value in record.items():
            if key not in ("type", "step") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, run_name: str | None, config: dict[str, Any], output_dir: Path, entity: str | None = None):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError("report_to includes 'wandb' but it is not installed: pip install 'tierlm[wandb]'") from e
        self.run = wandb.init(project=project, entity=entity, name=run_name, config=config, dir=str(output_dir))

    def log(self, record: dict[str, Any]) -> None:
        prefix = record.get("type", "train")
        self.run.log({f"{prefix}/{k}": v for k, v in record.items() if k not in ("type", "step")}, step=record.get("step"))

    def close(self) -> None:
        self.run.finish()


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
