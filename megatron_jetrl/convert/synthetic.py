"""Random tiny actor checkpoints in the models.shards layout, for tests, demos and memory measurements.

The HF tensors are drawn first and each TP x PP rank takes its slice through the one mapping table
(`rank_slice` + `from_hf`), exactly as an import of an HF model would place them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_jetrl.convert.layout import hf_shape
from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.models.mapping import from_hf, model_entries, padded_vocab_size, rank_slice
from megatron_jetrl.models.shards import save_rank_shard, write_meta


def tiny_config(model_type: str = "qwen3", **overrides) -> dict:
    """hidden 256, head_dim 128, 4 heads, 2 kv heads, intermediate 512, 2 layers, vocab 300."""
    config = dict(
        model_type=model_type,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=300,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.update(overrides)
    return config


def random_hf_state(arch: ModelArch, seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Random BF16 HF tensors; norms near 1 so that a forward stays well conditioned."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for entry in model_entries(arch):
        for name in entry.hf:
            shape = hf_shape(arch, name)
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:
                t = torch.randn(shape, generator=g) * std
            state[name] = t.to(torch.bfloat16)
    return state


def hf_state_for(
    config: dict,
    seed: int = 0,
    *,
    std: float = 0.05,
    embed_std: float = 0.1,
    norm_std: float = 0.1,
    bias_std: float = 0.5,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Random HF-named weights for an HF `config` dict (Qwen2, Qwen3, Llama), drawn in one fixed order whatever the
    dtype: linears ~N(0, std^2), embeddings ~N(0, embed_std^2), norm weights 1 + N(0, norm_std^2), Qwen2's QKV biases
    ~N(0, bias_std^2), Qwen3's QK norms; each drawn in FP32 and cast to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    H, I, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    nh, nkv, V = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    rnd = lambda *shape, s=std: (torch.randn(*shape, generator=g) * s).to(dtype)
    norm = lambda n: (1.0 + torch.randn(n, generator=g) * norm_std).to(dtype)
    state = {"model.embed_tokens.weight": rnd(V, H, s=embed_std), "model.norm.weight": norm(H)}
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = rnd(V, H)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = norm(H)
        state[p + "post_attention_layernorm.weight"] = norm(H)
        for name, shape in (
            ("self_attn.q_proj", (nh * hd, H)),
            ("self_attn.k_proj", (nkv * hd, H)),
            ("self_attn.v_proj", (nkv * hd, H)),
            ("self_attn.o_proj", (H, nh * hd)),
            ("mlp.gate_proj", (I, H)),
            ("mlp.up_proj", (I, H)),
            ("mlp.down_proj", (H, I)),
        ):
            state[p + name + ".weight"] = rnd(*shape)
        if config["model_type"] == "qwen2":
            state.update(
                {p + f"self_attn.{x}_proj.bias": rnd(n * hd, s=bias_std) for x, n in (("q", nh), ("k", nkv), ("v", nkv))}
            )
        if config["model_type"] == "qwen3":
            state.update({p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)})
    return state


def save_synthetic_checkpoint(
    directory: str | Path,
    hf_config: dict,
    *,
    tp: int = 1,
    pp: int = 1,
    flow: PrecisionFlow | None = None,
    spec: str = "local",
    seed: int = 0,
    hf_state: dict | None = None,
    iteration: int = 0,
    pp_last_layers: int = 0,
) -> dict:
    """Write a sealed TP x PP actor checkpoint of `hf_state` (default: random; `pp_last_layers`: an uneven pipeline
    split, as `parallel.pp_last_layers`) and return the HF state."""
    arch = ModelArch.from_hf_config(hf_config)
    hf = hf_state if hf_state is not None else random_hf_state(arch, seed)
    padded = padded_vocab_size(arch.vocab_size, tp)
    shards = []
    for p in range(pp):
        entries = model_entries(arch, pp_rank=p, pp_size=pp, spec=spec, last_layers=pp_last_layers)
        for r in range(tp):
            local = {
                e.megatron: from_hf(e, arch, {n: rank_slice(e, hf[n], r, tp, padded) for n in e.hf}).clone() for e in entries
            }
            shards.append(save_rank_shard(directory, local, r, p))
            del local
    write_meta(
        directory,
        iteration=iteration,
        tp=tp,
        pp=pp,
        spec=spec,
        hf_config=hf_config,
        flow=(flow or PrecisionFlow()).to_dict(),
        shards=shards,
        extra={"pp_last_layers": pp_last_layers} if pp_last_layers else None,
    )
    return hf
