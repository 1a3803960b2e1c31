"""Where vLLM's FP8 forward leaves the native engine's, linear by linear: where the train/rollout mismatch starts.

    python3 tools/gpu/diag_vllm_layers.py [--hidden 2048 --heads 16 --layers 28 ...] [--attention FLASH_ATTN|TRITON_ATTN]

Both engines get the trainer's FP8 bytes of one random model (the GPU tests' random init) and score one sequence
in one prefill (vLLM: `prompt_logprobs`; native: `score`). A forward pre-hook on each vLLM linear and a wrapper on
the native engine's `_linears` keep every FP8 linear's BF16 input. Per layer and linear the table gives the share
of BF16 elements that differ, the share of E4M3 bytes that differ after the shared 1x128 quantizer (what the GEMM
reads), and the relative L2 difference; then the prompt logprobs' mean |dlogp|. The first linear whose input
differs names the op that differs before it: the input norm (qkv), RoPE + attention (o), the residual add + norm
(gate_up), SiLU * up (down). Differences propagate (one changed E4M3 byte changes a whole GEMM output row), so the
op probes come first: vLLM's own layer-0 modules (RMSNorm, rotary embedding, SiLU-and-mul; both their CUDA and their
torch `forward_native` methods) on one input each against the trainer's functions (`actor.fused`, torch's
`F.silu(gate) * up`), share of BF16 output elements that differ.

`--glue trainer` (`VllmEngine(glue="trainer")`, `rollout.glue: trainer`) replaces vLLM's RMSNorm and RotaryEmbedding,
through vLLM's own out-of-tree op registry, by the trainer's functions (`rollout/vllm_glue.py`), so that what still
differs is attention and GEMM accumulation order (this tool's engines are eager).

Needs a CUDA GPU and vLLM 0.26.0 (the kit: tools/gpu/gpu_vllm.sh says how), run from the repo root.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINEARS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}


def vllm_inputs(engine):
    """Hooks on vLLM's linears: (layer, linear) -> the BF16 input of its first call after this."""
    seen, handles = {}, []
    for name, module in engine.model.named_modules():
        parts = name.split(".")
        if parts[-1] in LINEARS and "layers" in parts:
            key = (int(parts[parts.index("layers") + 1]), LINEARS[parts[-1]])
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, args, key=key: seen.setdefault(key, args[0].detach().reshape(-1, args[0].shape[-1]).clone())
                )
            )
    return seen, handles


def native_inputs(native):
    """The same for the native engine: its `_linears(x, *names)` is wrapped."""
    seen, inner = {}, native._linears

    def linears(x, *names):
        layer, proj = int(names[0].split(".")[2]), names[0].split(".")[-1]
        kind = {"q_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up", "down_proj": "down"}[proj]
        seen.setdefault((layer, kind), x.detach().reshape(-1, x.shape[-1]).clone())
        return inner(x, *names)

    native._linears = linears
    return seen


def compare(a: torch.Tensor, b: torch.Tensor, flow) -> tuple[float, float, float]:
    from megatron_jetrl.fp8 import quantize_blockwise

    qa, _ = quantize_blockwise(a, (1, 128), flow.scale_mode, eps=flow.eps)
    qb, _ = quantize_blockwise(b, (1, 128), flow.scale_mode, eps=flow.eps)
    bytes_differ = (qa.view(torch.uint8) != qb.view(torch.uint8)).float().mean().item()
    rel = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
    return (a != b).float().mean().item(), bytes_differ, rel


def op_probes(engine, arch) -> list[tuple[str, str, float]]:
    """(op, vLLM method, share of output elements that differ from the trainer's) for vLLM's layer-0 modules:
    RMSNorm and RoPE through `rollout.vllm_glue.probe` (the engine's start-up probe), SiLU * up here."""
    import torch.nn.functional as F

    from megatron_jetrl.rollout import vllm_glue

    layer, rows = engine.model.model.layers[0], []
    g = torch.Generator(device="cuda").manual_seed(1)
    gu = (torch.randn(512, 2 * arch.intermediate_size, device="cuda", generator=g) * 2).to(torch.bfloat16)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    for method in ("forward_cuda", "forward_native"):
        shares = vllm_glue.probe(layer, arch, "cuda", method=method)
        rows += [
            ("RMSNorm", method, shares["rms_norm"]),
            ("RMSNorm + residual", method, shares["rms_norm_residual"]),
            ("RoPE (q, k)", method, shares["rope"]),
            ("SiLU * up", method, (getattr(layer.mlp.act_fn, method)(gu.clone()) != want).float().mean().item()),
        ]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-type", default="qwen2")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8960)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--tokens", type=int, default=256, help="length of the scored sequence")
    p.add_argument("--attention", default="", help="vLLM attention backend (default: vLLM's choice, FlashAttention 3 on Hopper)")
    p.add_argument(
        "--custom-ops",
        default="",
        help="vLLM compilation_config custom_ops, comma list (e.g. -silu_and_mul: torch's forward_native)",
    )
    p.add_argument(
        "--glue",
        choices=("vllm", "trainer"),
        default="vllm",
        help="trainer: vLLM's RMSNorm and RoPE replaced by the trainer's (rollout.vllm_glue.register)",
    )
    p.add_argument("--show", type=int, default=4, help="table rows: the first SHOW layers and the last")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_vllm_layers.py needs a CUDA GPU and vLLM", file=sys.stderr)
        return 2
    import tempfile

    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
    from test_rollout_native import bf16_state, live_stream

    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models import ModelArch
    from megatron_jetrl.rollout.native import NativeEngine
    from megatron_jetrl.rollout.vllm_engine import VllmEngine, write_model_dir

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29613", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", rank=0, world_size=1)
    config = dict(
        model_type=args.model_type,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=128,
        vocab_size=args.vocab,
        max_position_embeddings=2048,
        eos_token_id=args.vocab - 1,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    flow, arch = PrecisionFlow("jetrl"), ModelArch.from_hf_config(config)
    extra = {"attention_config": {"backend": args.attention}} if args.attention else {}
    if args.custom_ops:
        extra["compilation_config"] = {"custom_ops": args.custom_ops.split(",")}
    engine = VllmEngine(
        write_model_dir(tempfile.mkdtemp(), config, flow),
        flow,
        eos_token_ids=[args.vocab - 1],
        seed=0,
        kv_cache_memory_bytes=4 << 30,
        gpu_memory_utilization=0.6,
        enforce_eager=True,
        max_model_len=2048,
        glue=args.glue,
        **extra,
    )
    state = {k: v.cuda() for k, v in bf16_state(arch, seed=3).items()}
    batch = dict(live_stream(arch, state, flow))
    engine.update_weights(batch.items())
    native = NativeEngine(arch, flow, device="cuda", batch_invariant=False, cuda_graphs=False)
    native.update_weights(batch.items(), require_complete=True)

    seq = torch.randint(0, args.vocab - 1, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    theirs, handles = vllm_inputs(engine)
    out = engine.llm.generate(
        [{"prompt_token_ids": seq}], engine._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    for h in handles:
        h.remove()
    ours = native_inputs(native)
    scores = native.score([seq])[0]
    v_lp = torch.tensor([out.prompt_logprobs[i][seq[i]].logprob for i in range(1, len(seq))])
    n_lp = torch.tensor(scores[: len(v_lp)])
    print(
        f"{torch.cuda.get_device_name()}; {config['model_type']} hidden {args.hidden}, {args.layers} layers, heads "
        f"{args.heads}/{args.kv_heads}; vLLM attention {args.attention or 'default'}; custom_ops {args.custom_ops or 'default'}; glue {engine.numerics['glue']}; kernels {engine.numerics.get('kernels')}"
    )
    print("| op (vLLM layer 0 vs the trainer's function) | vLLM method | output elements that differ |\n|---|---|---|")
    for op, method, share in op_probes(engine, arch):
        print(f"| {op} | {method} | {share:.2%} |")
    print("| layer | linear | BF16 inputs differ | E4M3 bytes differ | rel. L2 diff |\n|---|---|---|---|---|")
    layers = sorted({k[0] for k in ours})
    for layer in [*layers[: args.show], layers[-1]]:
        for kind in LINEARS.values():
            a, b = theirs.get((layer, kind)), ours.get((layer, kind))
            if a is None or b is None or a.shape != b.shape:
                print(
                    f"| {layer} | {kind} | shapes vLLM {None if a is None else tuple(a.shape)} native {None if b is None else tuple(b.shape)} | | |"
                )
                continue
            d, q, r = compare(a, b, flow)
            print(f"| {layer} | {kind} | {d:.2%} | {q:.2%} | {r:.2e} |")
    diff = (v_lp - n_lp).abs()
    print(
        f"prompt logprobs, vLLM vs native on the same bytes: mean |dlogp| {diff.mean():.4f}, max {diff.max():.4f} "
        f"({len(diff)} tokens)"
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
