"""GRPO, the algorithm, apart from the run that drives it (`megatron_jetrl.rl`): problems and prompts (`data`), answer
checking (`rewards`), tokenizers (`tokenizer`), group-normalized advantages (`advantages`), the clipped policy loss
(`loss`) and a step's experience as tensors (`batch`). It imports nothing of `megatron_jetrl.rl`. Import the submodules
directly; nothing is imported here.
"""
