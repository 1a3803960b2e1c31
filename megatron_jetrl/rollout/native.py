"""The native rollout engine: a small, exact PyTorch engine on the HF FP8 block format.

It reads what the converter writes and what live sync streams (`megatron_jetrl.models.hf_tensors`):
FP8 linears as E4M3 `<name>.weight` + FP32 `<name>.weight_scale_inv` (128x128 blocks), the rest BF16.
Its linears run the trainer's FProp (`fp8_linears_forward`: the linears that read one input, q/k/v and
gate/up, share its 1x128 quantization) whenever `flow.rollout_fp8`, and a BF16 linear otherwise. Nothing is
dequantized or re-quantized here. On CUDA, decode steps replay as CUDA graphs (`rollout/decode_graphs.py`).

Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and Llama-3 (llama3 rope scaling) share one forward.
Sequences are right-padded; each row has its own KV-cache length and positions. With
`batch_invariant=True` (default) every BF16 piece uses `megatron_jetrl.models.batch_invariant_ops`, and the FP8 GEMM's
emulated backend is batch invariant by construction, so on CPU a token's logprob is the same bits in
prefill, in KV-cache decode, in teacher-forced `score()`, and whatever its batch neighbours are.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_jetrl.actor.fused import fused_rms_norm, fused_rope
from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight, fp8_linears_forward
from megatron_jetrl.fp8.quant import NonFiniteInputError
from megatron_jetrl.models import ModelArch, model_entries
from megatron_jetrl.models import batch_invariant_ops as ops
from megatron_jetrl.models.export import stream_layout
from megatron_jetrl.models.mapping import KV_SCALE_SUFFIXES
from megatron_jetrl.rollout.decode_graphs import DecodeGraphs
from megatron_jetrl.rollout.engine import Completion, RequestOutput, SamplingParams, request_seeds_for
from megatron_jetrl.rollout.sampling import sample_tokens, sequence_generator

E4M3 = torch.float8_e4m3fn
SCALE_SUFFIX = ".weight_scale_inv"


class WeightUpdateError(ValueError):
    """A weight batch was refused; nothing of it was applied."""


def expected_tensors(arch: ModelArch, flow: PrecisionFlow) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every HF tensor the engine holds: name -> (shape, dtype), from the one mapping table (with the FP8 KV cache's
    scales where the trainer decides them: `PrecisionFlow.trainer_kv_scales`)."""
    entries = model_entries(arch, kv_scales=flow.trainer_kv_scales)
    return {name: (shape, dtype) for name, shape, dtype in stream_layout(arch, flow, entries)}


def collect_batch(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Materialize a weight stream; a name sent twice is refused."""
    batch: dict[str, torch.Tensor] = {}
    twice = []
    for name, tensor in weights:
        if name in batch:
            twice.append(name)
        batch[name] = tensor
    if twice:
        raise WeightUpdateError(f"refused a weight update: {twice[:5]} sent twice in one batch; nothing was applied")
    return batch


def validate_weights(
    specs: dict, batch: dict[str, torch.Tensor], *, require_complete: bool = False, family: str = ""
) -> list[str]:
    """Every problem of a weight batch against `expected_tensors` specs (empty list: acceptable).

    Unknown names, wrong dtypes or shapes, non-positive/non-finite scales (of weights and of the KV cache), an FP8 weight without its
    scales (or scales without their weight) in the same batch, and -- with `require_complete` -- missing tensors.
    """
    problems: list[str] = []
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in batch.items():
        spec = specs.get(name)
        if spec is None:
            close = difflib.get_close_matches(name, specs, n=1)
            problems.append(
                f"{name}: not a tensor of this {family} model".replace("  ", " ")
                + (f" (did you mean {close[0]!r}?)" if close else "")
            )
            continue
        shape, dtype = spec
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
            continue
        if tensor.dtype != dtype:
            hint = (
                " (an FP8 byte view must be viewed back as float8_e4m3fn: megatron_jetrl.rollout.sync.from_wire)"
                if dtype == E4M3 and tensor.dtype == torch.uint8
                else ""
            )
            problems.append(f"{name}: dtype {tensor.dtype}, expected {dtype}{hint}")
        if tuple(tensor.shape) != shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {shape}")
        if name.endswith((SCALE_SUFFIX, *KV_SCALE_SUFFIXES)) and tensor.dtype == torch.float32 and tuple(tensor.shape) == shape:
            scales[name] = tensor
    problems += [f"{name}: scales must be finite and positive" for name in _invalid_scales(scales)]
    for name in batch:  # FP8 bytes and their scales only make sense together
        if specs.get(name, (None, None))[1] == E4M3 and name.removesuffix(".weight") + SCALE_SUFFIX not in batch:
            problems.append(
                f"{name}: FP8 weight without its {name.removesuffix('.weight') + SCALE_SUFFIX} in the same batch (missing scales)"
            )
        if name.endswith(SCALE_SUFFIX) and name in specs and name.removesuffix(SCALE_SUFFIX) + ".weight" not in batch:
            problems.append(
                f"{name}: scales without their FP8 weight {name.removesuffix(SCALE_SUFFIX) + '.weight'} in the same batch"
            )
    if require_complete:
        missing = sorted(set(specs) - set(batch))
        if missing:
            problems.append(f"missing {len(missing)} tensor(s): {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return problems


def _invalid_scales(scales: dict[str, torch.Tensor]) -> list[str]:
    """Names of the scale tensors that are not all finite and > 0, with one host sync per device (a weight
    sync streams hundreds of scale tensors; one sync each would stall the stream that many times). All of a device's
    scales are checked in one concatenation (a few kernels, where a check per tensor costs a launch per tensor per
    sync); only a batch that fails is checked tensor by tensor, to name them."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in scales.items():
        by_device.setdefault(tensor.device, []).append((name, tensor))
    bad = []
    for items in by_device.values():
        flat = torch.cat([t.reshape(-1) for _, t in items])
        if bool((torch.isfinite(flat) & (flat > 0)).all()):
            continue
        ok = torch.stack([(torch.isfinite(t) & (t > 0)).all() for _, t in items]).tolist()
        bad += [name for (name, _), good in zip(items, ok, strict=True) if not good]
    return bad


def check_quantization_config(config: dict, flow: PrecisionFlow, where: str = "config.json") -> None:
    """Refuse a checkpoint whose precision is not the flow's rollout precision."""
    qc = config.get("quantization_config")
    if not flow.rollout_fp8:
        if qc is not None:
            raise ValueError(
                f"{where} declares quantization_config {qc} but the flow is mode={flow.mode!r} (BF16 rollout): "
                "load a BF16 checkpoint or use an FP8 mode"
            )
        return
    if qc is None:
        raise ValueError(
            f"{where} has no quantization_config but flow mode={flow.mode!r} rolls out in FP8: "
            "export the checkpoint with the flow (megatron_jetrl.models.hf_tensors) instead of quantizing here"
        )
    want = flow.quantization_config()
    problems = [f"{k}={qc.get(k)!r} (flow wants {v!r})" for k, v in want.items() if qc.get(k) != v]
    if qc.get("scale_fmt") not in (None, "float32") and "scale_fmt" not in want:
        problems.append(f"scale_fmt={qc.get('scale_fmt')!r} (flow scale_mode={flow.scale_mode!r})")
    if problems:
        raise ValueError(f"{where} quantization_config does not match the precision flow: " + ", ".join(problems))


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a lying header or a short file
        raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{index} is not valid JSON ({e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map {{tensor name: shard file}}")
    bad = [f for f in weight_map.values() if not isinstance(f, str) or not f or "/" in f or "\\" in f or f in (".", "..")]
    if bad:
        raise ValueError(f"{index} maps tensors to {bad[:3]}: shard files must be plain names inside {index.parent}")
    return weight_map


def read_hf_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every tensor of a local HF directory (model.safetensors or an index of shards).
    Anything malformed (JSON, index, safetensors header, a shard outside the directory) is a ValueError
    that names the file."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON ({e})") from None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _weight_map(index)
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            loaded = _load_safetensors(path / shard)
            stray = [n for n in loaded if weight_map.get(n) != shard]
            if stray:
                raise ValueError(f"{path / shard} holds {stray[:3]} which the index does not map to it")
            tensors.update(loaded)
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{index} maps {missing[:3]} ({len(missing)} in all) to shards that do not hold them")
        return config, tensors
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    return config, _load_safetensors(single)


class KVCache:
    """Per-layer K and V `[B, kv_heads, capacity, head_dim]`, zero-filled (masked slots stay finite).

    Head-major, so the first `span` slots of every (row, head) are one strided batch that attention's
    matmuls read in place (no copy, no repeat per query head)."""

    def __init__(self, arch: ModelArch, batch: int, capacity: int, device, dtype=torch.bfloat16):
        shape = (batch, arch.num_kv_heads, capacity, arch.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        self.capacity = capacity


class NativeEngine:
    """Pure-torch rollout engine (CPU and GPU) implementing `RolloutEngine`, plus `score()`."""

    def __init__(
        self,
        arch: ModelArch,
        flow: PrecisionFlow,
        *,
        device: str | torch.device = "cpu",
        eos_token_ids: Sequence[int] = (),
        tokenizer=None,
        batch_invariant: bool = True,
        cuda_graphs: bool | None = None,
    ):
        if flow.rollout_fp8:
            arch.check_fp8_tp(1)
        self.arch, self.flow, self.device = arch, flow, torch.device(device)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and not batch_invariant
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got {self.device}: leave cuda_graphs unset")
        self.cuda_graphs = cuda_graphs
        # A captured step cannot stop on the host for the quantizer's NaN/Inf check; NaN/Inf reaches the
        # logits instead (an inf scale makes NaN bytes), and generate() checks every logits row it samples.
        self._fwd_flow = dataclasses.replace(flow, check_finite="off") if cuda_graphs else flow
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.tokenizer = tokenizer
        self.batch_invariant = batch_invariant
        self.specs = expected_tensors(arch, flow)
        self.params: dict[str, torch.Tensor] = {}
        self._qweights: dict[str, QuantizedWeight] = {}
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.asleep = False

    # ---- loading -------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, flow: PrecisionFlow | None = None, **kwargs) -> NativeEngine:
        """Load a local HF directory (FP8 block checkpoint with quantization_config, or BF16)."""
        config, tensors = read_hf_checkpoint(path)
        qc = config.get("quantization_config")
        if flow is None:
            flow = (
                PrecisionFlow("jetrl", scale_mode="ue8m0" if (qc or {}).get("scale_fmt") == "ue8m0" else "fp32")
                if qc
                else PrecisionFlow("bf16")
            )
        check_quantization_config(config, flow, where=f"{Path(path) / 'config.json'}")
        eos = config.get("eos_token_id")
        kwargs.setdefault("eos_token_ids", [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))
        engine = cls(ModelArch.from_hf_config(config), flow, **kwargs)
        engine.update_weights(tensors.items(), require_complete=True)
        return engine

    def missing_weights(self) -> list[str]:
        return sorted(set(self.specs) - set(self.params))

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, require_complete: bool = False) -> None:
        """Validate the whole batch (names, shapes, dtypes, FP8 weight/scale pairs), then install it.

        On any problem raises `WeightUpdateError` listing them and leaves the engine's weights untouched.
        A batch may be a subset of the model (bucketed sync); an FP8 weight and its scale travel together.
        """
        batch = collect_batch(weights)
        problems = validate_weights(self.specs, batch, require_complete=require_complete, family=self.arch.family)
        if problems:
            raise WeightUpdateError(
                f"refused a weight update of {len(batch)} tensor(s); nothing was applied:\n  - "
                + "\n  - ".join(problems[:20])
                + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
            )
        target = torch.device("cpu") if self.asleep else self.device
        for name, tensor in batch.items():
            self.params[name] = tensor.detach().to(target, copy=True).contiguous()
        self._qweights.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.params)

    # ---- colocation ----------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Offload the weights to host memory (a no-op move on CPU); generate/score refuse until `wake()`."""
        self.params = {n: t.to("cpu") for n, t in self.params.items()}
        self._qweights.clear()
        self._rope = None
        self.asleep = True

    def wake(self) -> None:
        self.params = {n: t.to(self.device) for n, t in self.params.items()}
        self.asleep = False

    # ---- forward -------------------------------------------------------------------------------------

    def _ready(self):
        if self.asleep:
            raise RuntimeError("the engine is asleep: call wake() before generate() or score()")
        missing = self.missing_weights()
        if missing:
            raise RuntimeError(
                f"the engine has no weights for {len(missing)} tensor(s), e.g. {missing[:3]}: call update_weights first"
            )

    def _linears(self, x: torch.Tensor, *names: str) -> list[torch.Tensor]:
        """`x @ W^T (+ b)` for the named linears that read the same `x` (in FP8, `x` is quantized once)."""
        biases = [self.params.get(name + ".bias") for name in names]
        if self.flow.rollout_fp8:
            return fp8_linears_forward(x, [self._qweight(name) for name in names], biases, flow=self._fwd_flow)
        linear = ops.bi_linear if self.batch_invariant else F.linear
        return [linear(x, self.params[name + ".weight"], bias) for name, bias in zip(names, biases)]

    def _qweight(self, name: str) -> QuantizedWeight:
        qw = self._qweights.get(name)
        if qw is None:
            qw = self._qweights[name] = QuantizedWeight(self.params[name + ".weight"], self.params[name + SCALE_SUFFIX])
        return qw

    def _bf16_linear(self, x, weight):
        return ops.bi_linear(x, weight) if self.batch_invariant else F.linear(x, weight)

    def _rope_tables(self, needed: int):
        """cos/sin `[positions, head_dim]`: the trainer's SDPAttention's on the library-kernel path (megatron's,
        `rope_cos_sin`: FP32 angles; 0.4% of rotated outputs differ from FP64 ones), else FP64-angle tables
        (`ops.rope_tables`: the batch-invariant path's, and HF's for a rope scaling megatron cannot train)."""
        if self._rope is None or self._rope[0].shape[0] < needed:
            from megatron_jetrl.actor.fp8_layers import rope_cos_sin, rope_key

            a, length = self.arch, max(needed, self.arch.max_position_embeddings)
            try:
                key = None if self.batch_invariant else rope_key(a)
            except ValueError:  # e.g. llama3 scaling with factors megatron-core 0.16 does not implement
                key = None
            if key is None:
                self._rope = ops.rope_tables(a.head_dim, length, a.rope_theta, a.rope_scaling, self.device)
            else:
                cos, sin = rope_cos_sin(a.head_dim, key, length, self.device)
                self._rope = cos.view(length, -1), sin.view(length, -1)
        return self._rope

    def _rotate(self, x, cos, sin):
        """RoPE of x `[B, T, heads, D]` with cos/sin `[B, T, D]` -> `[B, heads, T, D]`: `ops.apply_rope`, or the
        trainer's `fused_rope` (the same FP32 formula; its Triton kernel on CUDA), one token per row."""
        if self.batch_invariant:
            return ops.apply_rope(x.transpose(1, 2), cos, sin)
        b, t, h, d = x.shape
        rows = (y.reshape(b * t, 1, 1, d) for y in (cos, sin))
        return fused_rope(x.reshape(b * t, 1, h, d), *rows).view(b, t, h, d).transpose(1, 2)

    def _norm(self, x, name, eps=None):
        """The trainer's RMSNorm: `ops.rms_norm`, or the actor's `fused_rms_norm` (its Triton kernel on CUDA).
        Both round the normalized row to BF16 before the weight multiplies it; torch's `F.rms_norm` rounds once,
        at the end, and differs in about a quarter of the elements (tests/unit/test_rollout_native.py)."""
        eps = self.arch.rms_norm_eps if eps is None else eps
        if self.batch_invariant:
            return ops.rms_norm(x, self.params[name], eps)
        return fused_rms_norm(x, self.params[name], eps)

    def _attend(self, q, k, v, q_pos, k_len, mask):
        """q `[B, H, Tq, D]`, k/v `[B, Hkv, Tk, D]` -> `[B, H, Tq, D]`; query at p sees keys `j <= p`, `j < k_len`
        (`mask` `[B, 1, Tq, Tk]`: the same, for the library kernels)."""
        if self.batch_invariant:
            return ops.attention(q, k, v, q_pos, k_len)
        b, h, tq, d = q.shape
        if tq == 1:  # decode: a KV head's query heads are its "queries", so K/V are read once, where they lie
            grouped = q.reshape(b, k.shape[1], h // k.shape[1], d)
            return F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask).reshape(b, h, 1, d)
        rep = h // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        k_len: torch.Tensor,
        cache: KVCache | None = None,
        rows: torch.Tensor | None = None,
        span: int | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states `[B, T, hidden]` for right-padded `tokens` `[B, T]` at `positions`.

        With `cache`, K/V of these tokens are written at their positions in the cache rows `rows`
        (default: all) and attention reads the first `span` slots of the cache (every row's keys lie there;
        slots past `k_len` are masked, and a masked slot adds an exact 0, so the bits do not depend on `span`);
        `k_len` is each row's valid length afterwards. With `span` given nothing here waits for the device.
        """
        a, p = self.arch, self.params
        b, t = tokens.shape
        if cache is not None and span is None:
            raise ValueError("hidden_states with a KV cache needs span (the number of cache slots to attend over)")
        cos_t, sin_t = self._rope_tables(span if span is not None else int(positions.max()) + 1)
        cos, sin = cos_t[positions], sin_t[positions]
        keys = torch.arange(span if cache is not None else t, device=tokens.device)
        mask = (
            None
            if self.batch_invariant
            else ((keys[None, None, :] <= positions[:, :, None]) & (keys[None, None, :] < k_len[:, None, None]))[:, None]
        )
        h = p["model.embed_tokens.weight"][tokens]
        row_idx = (torch.arange(b, device=tokens.device) if rows is None else rows)[:, None]
        for i in range(a.num_layers):
            pre = f"model.layers.{i}."
            x = self._norm(h, pre + "input_layernorm.weight")
            q, k, v = self._linears(x, *(pre + f"self_attn.{n}_proj" for n in "qkv"))
            q, k, v = (y.view(b, t, -1, a.head_dim) for y in (q, k, v))
            if a.qk_norm:
                q = self._norm(q, pre + "self_attn.q_norm.weight")
                k = self._norm(k, pre + "self_attn.k_norm.weight")
            qk = self._rotate(torch.cat([q, k], 2), cos, sin)  # elementwise: one call for both
            q, k = qk.split([a.num_heads, a.num_kv_heads], 1)  # [B, H, T, D], [B, Hkv, T, D]
            v = v.transpose(1, 2)
            if cache is not None:  # advanced indices (row, position) split by the head slice: value [B, T, Hkv, D]
                cache.k[i][row_idx, :, positions] = k.transpose(1, 2)
                cache.v[i][row_idx, :, positions] = v.transpose(1, 2)
                k, v = cache.k[i][:, :, :span], cache.v[i][:, :, :span]
                if rows is not None:
                    k, v = k[rows], v[rows]
            o = self._attend(q, k, v, positions, k_len, mask)
            h = h + self._linears(o.transpose(1, 2).reshape(b, t, a.num_heads * a.head_dim), pre + "self_attn.o_proj")[0]
            x = self._norm(h, pre + "post_attention_layernorm.weight")
            gate, up = self._linears(x, pre + "mlp.gate_proj", pre + "mlp.up_proj")
            act = ops.silu(gate) if self.batch_invariant else F.silu(gate)
            h = h + self._linears(act * up, pre + "mlp.down_proj")[0]
        return self._norm(h, "model.norm.weight")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """FP32 logits from final hidden states (the BF16 lm_head, tied to the embedding if configured)."""
        head = self.params["model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"]
        return self._bf16_linear(hidden, head).float()

    def _log_softmax(self, logits):
        return ops.log_softmax(logits) if self.batch_invariant else torch.log_softmax(logits.float(), -1)

    # ---- scoring -------------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced raw logprobs: for each sequence of length L, `log p(x_t | x_<t)` for t = 1..L-1."""
        self._ready()
        seqs = [list(map(int, s)) for s in token_ids]
        if any(len(s) < 1 for s in seqs):
            raise ValueError("score() needs non-empty sequences")
        tokens, lengths = self._pad(seqs)
        b, t = tokens.shape
        positions = torch.arange(t, device=self.device).expand(b, t)
        hidden = self.hidden_states(tokens, positions, lengths)
        lp = self._log_softmax(self.logits(hidden[:, :-1]))
        picked = lp.gather(-1, tokens[:, 1:, None])[..., 0].cpu()
        return [picked[i, : len(s) - 1].tolist() for i, s in enumerate(seqs)]

    def _pad(self, seqs):
        t = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), t, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        self._check_vocab(tokens)
        return tokens.to(self.device), torch.tensor([len(s) for s in seqs], device=self.device)

    def _check_vocab(self, tokens):
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.arch.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.arch.vocab_size}), got range [{int(tokens.min())}, {int(tokens.max())}]"
            )

    # ---- generation ----------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        *,
        request_seeds: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Sample `sampling.n` completions per prompt (all in one batch: prefill, then KV-cache decode)."""
        self._ready()
        sampling = sampling or SamplingParams()
        if sampling.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer (NativeEngine(..., tokenizer=...) with a decode(ids) method); use stop_token_ids"
            )
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts:
            return []
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if request_seeds is None:
            request_seeds = request_seeds_for(sampling, len(prompts))
        elif len(request_seeds) != len(prompts):
            raise ValueError(f"{len(request_seeds)} request_seeds for {len(prompts)} prompts")
        seeds = list(request_seeds) if request_seeds is not None else [None] * len(prompts)

        seqs = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        gens = [sequence_generator(seeds[i], j, self.device) for i, j in seqs]
        tokens, lengths = self._pad([prompts[i] for i, _ in seqs])
        b, t = tokens.shape
        capacity = t + sampling.max_new_tokens
        cache = KVCache(self.arch, b, capacity, self.device)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))

        positions = torch.arange(t, device=self.device).expand(b, t)
        hidden = self.hidden_states(tokens, positions, lengths, cache, span=t)
        last = self.logits(hidden[torch.arange(b, device=self.device), lengths - 1])  # [B, V]
        prompt_len = [len(prompts[i]) for i, _ in seqs]
        graphs = DecodeGraphs(self, cache) if self.cuda_graphs else None
        out_tokens = [[] for _ in seqs]
        out_lps = [[] for _ in seqs]
        finish: list[tuple[str, object] | None] = [None] * b
        texts: list[str | None] = [None] * b
        active = list(range(b))
        for step in range(sampling.max_new_tokens):
            # `last` holds the logits of the `active` rows (eager: compacted to them; graphs: of every cache row)
            logits = last if graphs is None else last[torch.tensor(active, device=self.device)]
            toks = sample_tokens(logits, sampling.temperature, sampling.top_p, [gens[s] for s in active])
            picked = self._log_softmax(logits).gather(-1, toks[:, None])[:, 0]
            finite = torch.isfinite(logits).all(-1)
            host = torch.stack([toks.double(), picked.double(), finite.double()]).tolist()  # the step's one host sync
            if not all(host[2]):
                bad = [active[r] for r, ok in enumerate(host[2]) if not ok]
                raise NonFiniteInputError(
                    f"NaN/Inf logits for completion(s) {bad[:8]} at generated token {step}: "
                    "the weights or activations hold non-finite values"
                )
            for s, tok, lp in zip(active, map(int, host[0]), host[1]):
                out_tokens[s].append(tok)
                out_lps[s].append(lp)
                if tok in stop_ids:
                    finish[s] = ("stop", tok if tok in sampling.stop_token_ids else None)
                elif sampling.stop:
                    text = self.tokenizer.decode(out_tokens[s])
                    hits = [(text.find(x), x) for x in sampling.stop if x in text]
                    if hits:
                        at, which = min(hits)
                        finish[s], texts[s] = ("stop", which), text[:at]
                if finish[s] is None and len(out_tokens[s]) >= sampling.max_new_tokens:
                    finish[s] = ("length", None)
            active = [s for s in active if finish[s] is None]
            if not active:
                break
            done = step + 1  # tokens generated per active row; the newest sits at prompt_len + done - 1
            if graphs is None:
                rows = torch.tensor(active, device=self.device)
                new = torch.tensor([[out_tokens[s][-1]] for s in active], device=self.device)
                pos = torch.tensor([[prompt_len[s] + done - 1] for s in active], device=self.device)
                hidden = self.hidden_states(new, pos, pos[:, 0] + 1, cache, rows, span=max(prompt_len[s] for s in active) + done)
                last = self.logits(hidden[:, 0])
            else:  # finished rows decode a dummy token at slot 0 of their own cache row; nobody reads it
                last = graphs.step(
                    [out_tokens[s][-1] if finish[s] is None else 0 for s in range(b)],
                    [prompt_len[s] + done - 1 if finish[s] is None else 0 for s in range(b)],
                )
        results = [RequestOutput(prompt_token_ids=p, request_seed=seeds[i]) for i, p in enumerate(prompts)]
        for s, (i, _) in enumerate(seqs):
            reason, why = finish[s]
            text = texts[s]
            if text is None and self.tokenizer is not None:
                text = self.tokenizer.decode(out_tokens[s])
            results[i].completions.append(Completion(out_tokens[s], out_lps[s], reason, why, text))
        return results
