"""megatron-jetrl: on-policy FP8 reinforcement learning (Jet-RL) with a Megatron-core actor.

Rooms (dependencies point one way): `fp8` <- `models` <- `actor`, `convert`, `rollout` <- `rl`.
"""

__version__ = "0.1.0"

from megatron_jetrl import third_party_logs

third_party_logs.install()
