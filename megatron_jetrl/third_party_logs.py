"""Two third-party log lines that tell a user of this package nothing, dropped where they are logged (by a filter on
the logger that emits them, matching the line alone; every other record of those loggers passes):

* megatron-core 0.16.1, `TransformerLayer.__init__` (logger `megatron.core.transformer.transformer_layer`):
  "Unknown MLP type: <class '...ModuleSpec'>. Using default kwargs.", once per layer. It names any MLP class other
  than megatron's own few; the only one this package builds is `actor.fp8_layers.FP8GatedMLP`, megatron's `MLP` with
  the same constructor, which then takes the default TP group of `parallel_state` as `MLP` would.
* torch, `torch.utils.cpp_extension` (imported by megatron-core's `nccl_allocator`): "No CUDA runtime is found,
  using CUDA_HOME=..." on a machine that has a CUDA toolkit but no GPU: this package compiles no torch extension.

`install()` is called once, from the package's `__init__`.
"""

from __future__ import annotations

import logging

DROPPED = {
    "megatron.core.transformer.transformer_layer": "Unknown MLP type: <class 'megatron.core.transformer.spec_utils.ModuleSpec'>",
    "torch.utils.cpp_extension": "No CUDA runtime is found",
}


class _DropLine(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def install() -> None:
    for name, prefix in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLine) for f in logger.filters):
            logger.addFilter(_DropLine(prefix))
