"""Megatron-core actor: model-parallel setup, training step and weight export for the RL actor."""

import warnings

import torch

# megatron-core warns once per module, at import, that Transformer Engine and Apex are missing (six warnings, twelve
# lines). On a CPU machine neither can be installed and the torch fallbacks are what the actor is meant to run, so
# the warnings say nothing there; on a GPU machine they stay (the fast paths are missing). Its deprecation of
# `cuda_graph_scope="full"` is about its own default, not a setting of ours.
if not torch.cuda.is_available():
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
