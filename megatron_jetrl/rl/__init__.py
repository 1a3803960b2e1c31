"""The run that drives GRPO (the algorithm is `megatron_jetrl.grpo`): the config and its one resolve pass, preflight
checks, the session (actor, reference, rollout pool, checkpoints), the loop (`train.py`) and its step (`step.py`), the run
context its watchers subscribe to (`context.py`: failure report, profiler, metrics), interrupts, the run lock, the
supervised warm-start (`sft.py`) and kernel warm-ups (`warm_gemms.py`, `warm_cache.py`). Import the submodules directly;
nothing is imported here.
"""
