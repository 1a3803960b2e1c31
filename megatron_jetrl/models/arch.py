"""Model families (Qwen2/Qwen2.5, Qwen3, Llama-3) read from a local HF `config.json`, and their FP8/TP checks."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_jetrl.fp8.quant import aligned_tp_sizes

FAMILIES = {
    # model_type -> (family, linear bias on q/k/v, RMS norm on q and k heads)
    "qwen2": ("qwen2", True, False),
    "qwen3": ("qwen3", False, True),
    "llama": ("llama", False, False),
}


@dataclass(frozen=True)
class ModelArch:
    """The architecture facts the actor, the converter and the rollout engine share."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict | None = None

    def __post_init__(self):
        if self.family not in {f for f, _, _ in FAMILIES.values()}:
            raise ValueError(f"unknown model family {self.family!r}; supported: {sorted(FAMILIES)}")
        sizes = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        bad = [f"{k}={v!r}" for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ValueError(f"config.json sizes must be positive integers: {', '.join(bad)}")
        if not (0 < self.rope_theta < math.inf and 0 < self.rms_norm_eps < 1):  # RoPE's frequencies, RMSNorm's floor
            raise ValueError(
                f"rope_theta must be a finite number > 0 and rms_norm_eps in (0, 1), got rope_theta={self.rope_theta!r}, "
                f"rms_norm_eps={self.rms_norm_eps!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def linear_params(self) -> int:
        """Weights of one decoder layer's four linears (qkv, o, gate_up, down): what its GEMMs scale with."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return (
            self.hidden_size * qkv
            + self.num_heads * self.head_dim * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
        )

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelArch:
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(
                f"config.json has model_type={model_type!r}; megatron-jetrl supports {sorted(FAMILIES)} "
                "(Qwen2/Qwen2.5, Qwen3, Llama-3)"
            )
        family, qkv_bias, qk_norm = FAMILIES[model_type]
        heads = config["num_attention_heads"]
        # transformers >= 5 writes RoPE settings as `rope_parameters` (theta + scaling); older configs use
        # top-level `rope_theta` / `rope_scaling`.
        rope = dict(config.get("rope_parameters") or {})
        rope_theta = config.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope_scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return cls(
            family=family,
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", qkv_bias)),
            qk_norm=qk_norm,
            rope_scaling=rope_scaling,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelArch:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}: point at a local HF model directory")
        return cls.from_hf_config(json.loads(config_path.read_text()))

    def to_dict(self) -> dict:
        return asdict(self)

    def split_dims(self, tp: int) -> list[tuple[str, int, int]]:
        """(what, full size, shards) for every dimension that TP splits across FP8 128x128 blocks."""
        hd, g = self.head_dim, self.num_kv_heads
        return [
            ("self_attention.linear_qkv: q rows of one query group", self.q_per_group * hd, 1),
            ("self_attention.linear_qkv: k and v rows of one query group (head_dim)", hd, 1),
            ("self_attention.linear_qkv: output rows (query groups)", g * (self.q_per_group + 2) * hd, tp),
            ("self_attention.linear_proj: input dim (heads x head_dim)", self.num_heads * hd, tp),
            ("mlp.linear_fc1 gate/up rows and mlp.linear_fc2 input dim (intermediate_size)", self.intermediate_size, tp),
        ]

    def check_fp8_tp(self, tp: int, block: int = 128) -> None:
        """Refuse a TP size at which a 128x128 FP8 block would straddle a shard or a fused piece."""
        if self.num_kv_heads % tp:
            raise ValueError(f"TP={tp} does not divide num_key_value_heads={self.num_kv_heads}: query groups cannot be split")
        problems = []
        for what, size, parts in self.split_dims(tp):
            if size % parts or (size // parts) % block:
                fits = [t for t in aligned_tp_sizes(size, block) if self.num_kv_heads % t == 0] if parts > 1 else []
                hint = f"TP sizes that work for it: {fits}" if fits else f"no TP size helps: {size} is not made of {block}-blocks"
                problems.append(f"{what}: {size} / {parts} = {size / parts:g} is not a multiple of {block} ({hint})")
        if problems:
            raise ValueError(
                f"{self.family} model cannot run FP8 128x128 blocks at TP={tp}; every layer has:\n  - " + "\n  - ".join(problems)
            )
