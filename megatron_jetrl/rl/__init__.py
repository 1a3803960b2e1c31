"""GRPO on top of the FP8 actor and rollout engines: problems and prompts (`data`), answer checking
(`rewards`), tokenizers (`tokenizer`), group-normalized advantages (`advantages`), the clipped policy loss
(`loss`) and the training loop. Import the submodules directly; nothing is imported here.
"""
