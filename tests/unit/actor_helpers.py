"""Shared by tests/unit/test_actor_*.py: tiny random HF checkpoints, an independent torch reference of the
Qwen2/Qwen3/Llama forward, and gloo process helpers."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from gloo import free_port, one_gloo_rank  # noqa: F401  (re-exported for the actor tests)
from safetensors.torch import save_file

from megatron_jetrl.convert.synthetic import hf_state_for

REPO_ROOT = Path(__file__).resolve().parents[2]
SEQ = 32

BASE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    vocab_size=300,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
CONFIGS = {
    "qwen2": dict(BASE, model_type="qwen2", rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(BASE, model_type="qwen3", rope_theta=1000000.0, tie_word_embeddings=False),
    "llama": dict(
        BASE,
        model_type="llama",
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def hf_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named FP32 weights (norm weights near 1, linears ~N(0, 0.05^2), embeddings ~N(0, 0.1^2))."""
    return hf_state_for(config, seed)


def write_hf_checkpoint(directory: Path, config: dict, state: dict, *, sharded: bool, dtype=torch.bfloat16) -> Path:
    """config.json + model.safetensors, or two files + model.safetensors.index.json when `sharded`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {k: v.to(dtype).contiguous() for k, v in state.items()}
    if not sharded:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, str(directory / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


# --- independent torch reference of the HF forward --------------------------------------------------------


def _rms(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _inv_freq(config):
    hd, theta = config["head_dim"], config["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    rs = config.get("rope_scaling")
    if rs:  # HF's _compute_llama3_parameters
        factor, low, high, old = (
            rs["factor"],
            rs["low_freq_factor"],
            rs["high_freq_factor"],
            rs["original_max_position_embeddings"],
        )
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _attention(q, k, v):
    """Causal GQA attention, q `[b, s, heads, hd]`, k/v `[b, s, groups, hd]` -> `[b, s, heads * hd]`, through torch's
    SDPA as the native spec's `SDPAttention` calls it (enable_gqa, default scale): the FP8 reference must feed its
    quantizers the same bits, or last-bit differences flip E4M3 roundings and move the logits by the FP8 noise
    itself (~1e-1 here)."""
    b, s, nh, hd = q.shape
    out = F.scaled_dot_product_attention(*(t.permute(0, 2, 1, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    return out.permute(0, 2, 1, 3).reshape(b, s, nh * hd)


def reference_logits(config: dict, state: dict, tokens: torch.Tensor, linear=None) -> torch.Tensor:
    """HF-style forward in FP32: `tokens[b, s]` -> logits `[b, s, vocab]`. `linear(x, W, b)`: default F.linear."""
    linear = linear or (lambda x, w, b=None: F.linear(x, w, b))
    w = {k: v.float() for k, v in state.items()}
    eps, hd = config["rms_norm_eps"], config["head_dim"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    b, s = tokens.shape
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), _inv_freq(config))
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None, :, None], emb.sin()[None, :, None]
    h = w["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q, k, v = (linear(x, w[p + f"self_attn.{n}_proj.weight"], w.get(p + f"self_attn.{n}_proj.bias")) for n in "qkv")
        q, k, v = q.view(b, s, nh, hd), k.view(b, s, nkv, hd), v.view(b, s, nkv, hd)
        if p + "self_attn.q_norm.weight" in w:
            q, k = _rms(q, w[p + "self_attn.q_norm.weight"], eps), _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        attn = _attention(q, k, v)
        h = h + linear(attn, w[p + "self_attn.o_proj.weight"])
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(linear(x, w[p + "mlp.gate_proj.weight"])) * linear(x, w[p + "mlp.up_proj.weight"])
        h = h + linear(mlp, w[p + "mlp.down_proj.weight"])
    h = _rms(h, w["model.norm.weight"], eps)
    return h @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).t()


def fp8_reference_linear(flow):
    """The emulated FP8 forward of the core (`fp8_linear_forward`) on separately quantized HF weights."""
    from megatron_jetrl.fp8 import QuantizedWeight, fp8_linear_forward

    return lambda x, w, b=None: fp8_linear_forward(x, QuantizedWeight.quantize(w, flow), b, flow=flow)


def tokens_for(config: dict, batch: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, config["vocab_size"], (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def rounded_state(state: dict, dtype=torch.bfloat16) -> dict:
    """What a checkpoint saved in `dtype` holds, back in FP32."""
    return {k: v.to(dtype).float() for k, v in state.items()}


# --- gloo process helpers -----------------------------------------------------------------------------------


def _entry(rank, world, port, tp, pp, fn, args, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from megatron_jetrl.actor.parallel import destroy_parallel, init_parallel

    init_parallel(tp=tp, pp=pp, seed=1234)
    try:
        result = fn(*args)
    finally:
        destroy_parallel()
    torch.save(result, Path(outdir, f"rank{rank}.pt"))


def spawn(world: int, tp: int, pp: int, fn, *args) -> list:
    """Run `fn(*args)` on `world` gloo ranks (TP x PP, the rest DP); returns each rank's return value."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, free_port(), tp, pp, fn, args, d), nprocs=world, join=True)
        return [torch.load(Path(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def tp_rank_config(hidden: int, sequence_parallel: bool, dtype: torch.dtype):
    """(megatron TransformerConfig of one small layer over this gloo rank's TP group, TP size, TP rank): for tests of
    single megatron modules (the embedding, the output layer) under TP."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    group = ps.get_tensor_model_parallel_group()
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=2, tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel, use_cpu_initialization=True, params_dtype=dtype,
    )  # fmt: skip
    return cfg, tp, rank
