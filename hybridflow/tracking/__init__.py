"""Experiment tracking: console table, metrics.jsonl, TensorBoard, MLflow, W&B; plots."""
from hybridflow.tracking.flatten import flatten_config
from hybridflow.tracking.jsonl_logger import METRICS_FILE
from hybridflow.tracking.plot import plot_metrics, read_metrics
from hybridflow.tracking.tracker import BACKENDS, Tracker, with_jsonl

__all__ = ["BACKENDS", "METRICS_FILE", "Tracker", "flatten_config", "plot_metrics",
           "read_metrics", "with_jsonl"]
