"""Rollout: the `RolloutEngine` protocol, the native reference engine, the vLLM engine, weight sync,
the data-parallel pool and the train/rollout mismatch metrics."""

from megatron_jetrl.rollout.engine import Completion, RequestOutput, RolloutEngine, SamplingParams
from megatron_jetrl.rollout.native import NativeEngine, WeightUpdateError, expected_tensors, read_hf_checkpoint

__all__ = [
    "Completion", "NativeEngine", "RequestOutput", "RolloutEngine", "SamplingParams", "WeightUpdateError",
    "expected_tensors", "read_hf_checkpoint",
]
