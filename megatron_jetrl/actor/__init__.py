"""Megatron-core actor: model-parallel setup, training step and weight export for the RL actor."""
