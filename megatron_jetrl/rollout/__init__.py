"""Rollout: the `RolloutEngine` protocol, the native reference engine, the vLLM engine (lazy), weight sync,
the data-parallel pool and the train/rollout mismatch metrics."""

from megatron_jetrl.rollout.engine import Completion, RequestOutput, RolloutEngine, SamplingParams
from megatron_jetrl.rollout.metrics import flat_metrics, mismatch_metrics
from megatron_jetrl.rollout.native import NativeEngine, WeightUpdateError, expected_tensors, read_hf_checkpoint
from megatron_jetrl.rollout.pool import RolloutPool
from megatron_jetrl.rollout.sync import SyncStats, stream_weights

__all__ = [
    "Completion",
    "NativeEngine",
    "RequestOutput",
    "RolloutEngine",
    "RolloutPool",
    "SamplingParams",
    "SyncStats",
    "WeightUpdateError",
    "expected_tensors",
    "flat_metrics",
    "mismatch_metrics",
    "read_hf_checkpoint",
    "stream_weights",
]
