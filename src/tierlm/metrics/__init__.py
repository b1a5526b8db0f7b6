"""Metrics: sinks (JSONL, TensorBoard, W&B) and throughput/MFU estimates."""

from tierlm.metrics.flops import flops_per_token, peak_flops
from tierlm.metrics.sinks import JSONLSink, MetricsLogger, MLflowSink, TensorBoardSink, WandbSink

__all__ = ["JSONLSink", "MLflowSink", "MetricsLogger", "TensorBoardSink", "WandbSink", "flops_per_token", "peak_flops"]
