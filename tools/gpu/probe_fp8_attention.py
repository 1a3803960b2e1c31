"""FP8 attention as vLLM 0.26 runs it with an FP8 KV cache (FA3, e4m3 Q/K/V, per-tensor descales): which actor-side
calls give the engine's bytes, what the quantizers compute, the backward's error, and the kernels' times.

    source /tmp/vllm-site/env.sh && PYTHONPATH=/tmp/mcore:$PYTHONPATH python3 tools/gpu/probe_fp8_attention.py \
        [--sections quant bytes backward speed decode pages pieces aot]

(/tmp/mcore: megatron-core, which `actor.rollout_kernels` imports, installed from .whl/ as tools/gpu/gpu_vllm.sh does.)

`pages`: the pinned FP8 decode by the cache's page size (16 ... 448 tokens) and launch floor (17, 33, 65): FA3 loads
a paged cache with TMA only at a page that is a multiple of its key tile; time and bytes against the actor's forward.
`pieces`: the actor's forward cut into 16-query pieces so FA3 keeps its one-warpgroup kernel, as an unpinned decode
does: whether its bytes are the decode's, and what the pieces cost the forward.

`aot`: the decode launched with and without the scheduler metadata vLLM makes ahead of time once a step (which its
batch-invariant mode, and so the one-split pin, turns off): what that costs, and whether the pinned launch keeps its
bytes with it.

`decode`: one decode step's attention at the long-rollout runs' shape (an engine's 32 sequences at context 4160, and
64 and 128 of them), BF16 and FP8 caches, each as vLLM launches it on its own (FA3's KV-split heuristic) and with the
exact-logprob pins (one KV split; in FP8 also the two-warpgroup kernel's launch floor): what each pin costs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from vllm import _custom_ops as ops
from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megatron_jetrl.actor.rollout_kernels import fp8_attention_min_q  # noqa: E402

E4M3 = torch.float8_e4m3fn
H, HK, D = 32, 8, 128
SCALE = D**-0.5
dev = "cuda"


def rows(*ts):
    return [t.contiguous() for t in ts]


def paged_cache(k, v, lengths, page, k_scale, v_scale, dtype="fp8", shuffle=True, seed=0):
    """vLLM's cache (num_blocks, page, HK, 2D) filled by its own op, blocks in a shuffled order; -> (kc, vc, table)."""
    pages = [(n + page - 1) // page for n in lengths]
    total = sum(pages) + 3
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)) if shuffle else torch.arange(total)
    cache = torch.zeros(total, page, HK, 2 * D, dtype=torch.uint8 if dtype == "fp8" else torch.bfloat16, device=dev)
    kc, vc = cache[..., :D], cache[..., D:]
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32, device=dev)
    slots, at = [], 0
    for i, (n, p) in enumerate(zip(lengths, pages)):
        blocks = order[at : at + p]
        at += p
        table[i, :p] = blocks.to(dev, torch.int32)
        t = torch.arange(n)
        slots.append(blocks[t // page] * page + t % page)
    ops.reshape_and_cache_flash(k, v, kc, vc, torch.cat(slots).to(dev), dtype, k_scale, v_scale)
    if dtype == "fp8":
        kc, vc = kc.view(E4M3), vc.view(E4M3)
    return kc, vc, table


def fa(q, kc, vc, cu_q, max_q, seqused, max_k, table, descales, lse=False, cu_k=None, causal=True, num_splits=1, meta=None):
    qd, kd, vd = descales if descales else (None, None, None)
    n = cu_q.numel() - 1
    ex = (lambda s: s.expand(n, HK)) if descales else (lambda s: None)
    return flash_attn_varlen_func(
        q,
        kc,
        vc,
        max_seqlen_q=max_q,
        cu_seqlens_q=cu_q,
        max_seqlen_k=max_k,
        seqused_k=None if cu_k is not None else seqused,
        cu_seqlens_k=cu_k,
        block_table=table,
        softmax_scale=SCALE,
        causal=causal,
        fa_version=3,
        num_splits=num_splits,
        return_softmax_lse=lse,
        q_descale=ex(qd) if descales else None,
        k_descale=ex(kd) if descales else None,
        v_descale=ex(vd) if descales else None,
        scheduler_metadata=meta,
    )


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)


def quantizers():
    print("== quantizers: vLLM's ops against torch arithmetic (bytes differing / elements)")
    g = torch.Generator(device=dev).manual_seed(1)
    x = (torch.randn(4096, HK * D, generator=g, device=dev) * 3).bfloat16()
    x[0, :8] = torch.tensor([1e4, -1e4, 0.0, -0.0, 448 * 0.7, 1e-9, float("inf"), 3.0])
    for s in (0.013, 0.7, 1.0, 2.5e-3):
        sc = torch.tensor(s, device=dev)
        kc = torch.zeros(4096, 1, HK, 2 * D, dtype=torch.uint8, device=dev)
        ops.reshape_and_cache_flash(
            x.view(4096, HK, D), x.view(4096, HK, D), kc[..., :D], kc[..., D:], torch.arange(4096, device=dev), "fp8", sc, sc
        )
        cache = kc[..., :D].reshape(4096, HK * D)
        qq, _ = ops.scaled_fp8_quant(x, sc)
        div = (x.float() / sc).clamp(-448, 448).to(E4M3).view(torch.uint8)
        mul = (x.float() * (1.0 / sc)).clamp(-448, 448).to(E4M3).view(torch.uint8)
        print(
            f"scale {s:>8}: cache op vs div {int((cache != div).sum())}, vs mul-recip {int((cache != mul).sum())}; "
            f"scaled_fp8_quant vs div {int((qq.view(torch.uint8) != div).sum())}, vs mul {int((qq.view(torch.uint8) != mul).sum())}, "
            f"vs cache op {int((qq.view(torch.uint8) != cache).sum())}"
        )


def fp8_inputs(m: int, g: torch.Generator):
    """`m` tokens of random q, k, v (BF16), their per-tensor amax scales `[q, k, v]` and q's E4M3 bytes as vLLM makes them."""
    q = torch.randn(m, H, D, generator=g, device=dev).bfloat16() * 2
    k = torch.randn(m, HK, D, generator=g, device=dev).bfloat16() * 2
    v = torch.randn(m, HK, D, generator=g, device=dev).bfloat16()
    sc = [torch.tensor(t.abs().max().item() / 448, device=dev) for t in (q, k, v)]
    return q, k, v, sc, ops.scaled_fp8_quant(q.reshape(m, H * D), sc[0])[0].view(m, H, D)


def decode_inputs(batch: int, context: int, seed: int):
    """A decode step's random BF16 inputs: K and V of `batch` sequences of `context` tokens, one query each, the scale
    1.0 and the sequences' lengths on the device."""
    g = torch.Generator(device=dev).manual_seed(seed)
    n = batch * context
    k = torch.randn(n, HK, D, generator=g, device=dev).bfloat16()
    v = torch.randn(n, HK, D, generator=g, device=dev).bfloat16()
    q = torch.randn(batch, H, D, generator=g, device=dev).bfloat16()
    lens = torch.tensor([context] * batch, dtype=torch.int32, device=dev)
    return k, v, q, torch.tensor(1.0, device=dev), lens


def equality(lengths, page, chunk):
    g = torch.Generator(device=dev).manual_seed(2)
    n = sum(lengths)
    q, k, v, (qs, ks, vs), q8 = fp8_inputs(n, g)
    kc, vc, table = paged_cache(k, v, lengths, page, ks, vs)
    cq = cu(lengths)
    L = max(lengths)
    lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    whole = fa(q8, kc, vc, cq, L, lens, L, table, (qs, ks, vs))
    out = {"dtype": str(whole.dtype)}
    # contiguous K/V (no block table): the actor's former call
    k8 = (k.float() / ks).clamp(-448, 448).to(E4M3)
    v8 = (v.float() / vs).clamp(-448, 448).to(E4M3)
    contig = fa(q8, k8, v8, cq, L, None, L, None, (qs, ks, vs), cu_k=cq)
    out["contiguous vs paged"] = int((contig != whole).sum())
    # chunked prefill: [0, c) then [c, n) of each sequence
    first = [min(chunk, x) for x in lengths]
    rest = [x - f for x, f in zip(lengths, first)]
    starts = cq[:-1].tolist()
    qa = torch.cat([q8[s : s + f] for s, f in zip(starts, first)])
    qb = torch.cat([q8[s + f : s + x] for s, f, x in zip(starts, first, lengths)])
    a = fa(qa, kc, vc, cu(first), max(first), torch.tensor(first, dtype=torch.int32, device=dev), max(first), table, (qs, ks, vs))
    b = fa(qb, kc, vc, cu(rest), max(rest), lens, L, table, (qs, ks, vs))
    chunked = torch.cat(
        [
            torch.cat([a[sa : sa + f], b[sb : sb + r]])
            for sa, sb, f, r in zip(cu(first)[:-1].tolist(), cu(rest)[:-1].tolist(), first, rest)
        ]
    )
    out["chunked vs whole"] = int((chunked != whole).sum())
    # paged decode: one query per sequence, a batch of all sequences, at several positions; variants of the call
    kb, vb, tb = paged_cache(k, v, lengths, page, ks, vs, dtype="auto")
    wb = fa(q, kb, vb, cq, L, lens, L, tb, None)
    diff = {"decode": 0, "decode max_q=2": 0, "decode causal=False": 0, "decode in mixed batch": 0, "bf16 decode": 0}
    for back in (1, 2, 7, 100, 513):
        pos = [x - back for x in lengths]
        qd = torch.stack([q8[s + p] for s, p in zip(starts, pos)])
        used = torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=dev)
        want = torch.stack([whole[s + p] for s, p in zip(starts, pos)])
        one = cu([1] * len(lengths))
        d = fa(qd, kc, vc, one, 1, used, max(pos) + 1, table, (qs, ks, vs))
        diff["decode"] += int((d != want).sum())
        d = fa(qd, kc, vc, one, 2, used, max(pos) + 1, table, (qs, ks, vs))
        diff["decode max_q=2"] += int((d != want).sum())
        d = fa(qd, kc, vc, one, 1, used, max(pos) + 1, table, (qs, ks, vs), causal=False)
        diff["decode causal=False"] += int((d != want).sum())
        # sequence 0 prefills its last 64 tokens while the others decode one token
        n0 = min(64, pos[0] + 1)
        qm = torch.cat([q8[starts[0] + pos[0] + 1 - n0 : starts[0] + pos[0] + 1], qd[1:]])
        d = fa(qm, kc, vc, cu([n0] + [1] * (len(lengths) - 1)), n0, used, max(pos) + 1, table, (qs, ks, vs))
        diff["decode in mixed batch"] += int((torch.cat([d[n0 - 1 : n0], d[n0:]]) != want).sum())
        qdb = torch.stack([q[s + p] for s, p in zip(starts, pos)])
        d = fa(qdb, kb, vb, one, 1, used, max(pos) + 1, tb, None)
        diff["bf16 decode"] += int((d != torch.stack([wb[s + p] for s, p in zip(starts, pos)])).sum())
    out.update(diff)
    # every token its own one-query sequence (decode-style) against the engine's decode
    m = min(lengths[0], 300)
    pos = torch.arange(lengths[0] - m, lengths[0], device=dev)
    tok = fa(q8[pos], kc, vc, cu([1] * m), 1, (pos + 1).int(), lengths[0], table[:1].expand(m, -1).contiguous(), (qs, ks, vs))
    d = fa(q8[pos[-1:]], kc, vc, cu([1]), 1, (pos[-1:] + 1).int(), lengths[0], table[:1], (qs, ks, vs))
    out["per-token decode-style vs decode (last token)"] = int((tok[-1:] != d).sum())
    out["per-token decode-style vs whole"] = int((tok != whole[pos]).sum())
    # the same query alone (batch of one) vs in the batch
    one = fa(q8[: lengths[0]], kc, vc, cu(lengths[:1]), lengths[0], lens[:1], lengths[0], table[:1], (qs, ks, vs))
    out["alone vs batch"] = int((one != whole[: lengths[0]]).sum())
    # FP8 against BF16 attention
    ref = wb
    out["fp8 vs bf16 rel err"] = f"{((whole.float() - ref.float()).norm() / ref.float().norm()).item():.4f}"
    return out


def backward():
    """Forward FP8 FA3 (paged), backward flash attention's BF16 gradient on the dequantized inputs, against FP64."""
    g = torch.Generator(device=dev).manual_seed(3)
    b, s = 2, 512
    q = torch.randn(b * s, H, D, generator=g, device=dev).bfloat16()
    k = torch.randn(b * s, HK, D, generator=g, device=dev).bfloat16()
    v = torch.randn(b * s, HK, D, generator=g, device=dev).bfloat16()
    qs, ks, vs = (torch.tensor(t.abs().max().item() / 448, device=dev) for t in (q, k, v))
    q8, _ = ops.scaled_fp8_quant(q.reshape(b * s, H * D), qs)
    kc, vc, table = paged_cache(k, v, [s] * b, 16, ks, vs)
    out, lse = fa(
        q8.view(b * s, H, D),
        kc,
        vc,
        cu([s] * b),
        s,
        torch.tensor([s] * b, dtype=torch.int32, device=dev),
        s,
        table,
        (qs, ks, vs),
        lse=True,
    )
    deq = lambda t8, sc: (t8.float() * sc).bfloat16()  # noqa: E731
    qd = deq(q8.view(b * s, H, D), qs).view(b, s, H, D)
    kd = deq((k.float() / ks).clamp(-448, 448).to(E4M3), ks).view(b, s, HK, D)
    vd = deq((v.float() / vs).clamp(-448, 448).to(E4M3), vs).view(b, s, HK, D)
    grad = torch.randn(b, s, H, D, generator=g, device=dev).bfloat16()
    lse_b = lse.view(H, b, s).transpose(0, 1).contiguous()
    none = torch.empty(0, device=dev)
    kk, vv = (t.repeat_interleave(H // HK, dim=2) for t in (kd, vd))
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad, qd, kk, vv, out.view(b, s, H, D), lse_b, None, None, s, s, 0.0, True, none, none, scale=SCALE
    )
    dk = dk.view(b, s, HK, H // HK, D).sum(3)
    dv = dv.view(b, s, HK, H // HK, D).sum(3)
    res = {}
    for name, inputs in (
        ("dequantized", (qd, kd, vd)),
        ("bf16 inputs", (q.view(b, s, H, D), k.view(b, s, HK, D), v.view(b, s, HK, D))),
    ):
        qt, kt, vt = (t.double().transpose(1, 2).requires_grad_() for t in inputs)
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=SCALE, enable_gqa=True)
        rq, rk, rv = torch.autograd.grad(ref, (qt, kt, vt), grad.double().transpose(1, 2))
        ref = ref.transpose(1, 2)
        res[f"out vs fp64 ({name})"] = ((out.view(b, s, H, D).double() - ref).norm() / ref.norm()).item()
        for nm, mine, want in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
            want = want.transpose(1, 2)
            res[f"{nm} vs fp64 ({name})"] = ((mine.double() - want).norm() / want.norm()).item()
    for key, val in res.items():
        print(f"  {key}: {val:.4f}")


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def speed():
    print("== kernel times (ms), one split, page 16")
    for label, lengths, decode in (
        ("prefill 4 x 8192", [8192] * 4, False),
        ("decode 64 x ctx 8192", [8192] * 64, True),
        ("decode 256 x ctx 4096", [4096] * 256, True),
        ("decode 128 x ctx 1024", [1024] * 128, True),
    ):
        n = sum(lengths)
        g = torch.Generator(device=dev).manual_seed(4)
        k = torch.randn(n, HK, D, generator=g, device=dev).bfloat16()
        v = torch.randn(n, HK, D, generator=g, device=dev).bfloat16()
        nq = len(lengths) if decode else n
        q = torch.randn(nq, H, D, generator=g, device=dev).bfloat16()
        one = torch.tensor(1.0, device=dev)
        lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        cq = cu([1] * len(lengths)) if decode else cu(lengths)
        mq = 1 if decode else max(lengths)
        res = []
        for dtype in ("auto", "fp8"):
            kc, vc, table = paged_cache(k, v, lengths, 16, one, one, dtype=dtype, shuffle=False)
            qq = ops.scaled_fp8_quant(q.reshape(nq, -1), one)[0].view(nq, H, D) if dtype == "fp8" else q
            d = (one, one, one) if dtype == "fp8" else None
            res.append(timed(lambda: fa(qq, kc, vc, cq, mq, lens, max(lengths), table, d)))
            if dtype == "fp8" and decode:
                res.append(timed(lambda: fa(qq, kc, vc, cq, 2, lens, max(lengths), table, d)))
            del kc, vc
        print(
            f"  {label}: bf16 {res[0]:.3f}  fp8 {res[1]:.3f}  ratio {res[0] / res[1]:.2f}x"
            + (f"  fp8 max_q=2 {res[2]:.3f}" if decode else "")
        )


def fa3_unpacked(q, kc, vc, cu_q, max_q, seqused, max_k, table, descales):
    """`fa`'s paged causal launch with one split and GQA packing off (vLLM 0.26's Python wrapper always passes FA3's
    heuristic, which packs a varlen batch): each query head its own CTA rows, where packing puts a KV head's query
    heads in one tile. Its op's positional arguments as vllm_flash_attn.flash_attn_interface passes them."""
    qd, kd, vd = descales if descales else (None, None, None)
    n = cu_q.numel() - 1
    ex = (lambda s: s.expand(n, HK)) if descales else (lambda s: None)
    out, *_ = torch.ops._vllm_fa3_C.fwd(
        q, kc, vc, None, None, None, None, cu_q, None, None, None, seqused, max_q, max_k, table, None, None, None, None,
        None, ex(qd), ex(kd), ex(vd), SCALE, True, -1, -1, 0.0, True, None, 1, False, 0, None, 1, 0, None,
    )  # fmt: skip
    return out


def decode_pins(context: int = 4160, batches=(32, 64, 128)):
    """One decode step's attention per batch: BF16 and FP8 caches, FA3's own split heuristic (num_splits 0) against
    the exact-logprob pins (one split; FP8 also the launch floor `fp8_attention_min_q`), ms and TB/s of cache read."""
    floor = fp8_attention_min_q(H, HK)
    print(
        f"== decode at context {context}: attention ms (cache TB/s); splits 0 = FA3's heuristic, pins = one split"
        f" (FP8: + max_seqlen_q {floor})"
    )
    print(
        "  batch | bf16 splits | bf16 one split | fp8 splits | fp8 one split | fp8 pins | fp8 pins vs bf16 pins"
        " | unpacked GQA: bf16 one split, fp8 pins (elements differing from packed)"
    )
    for batch in batches:
        lengths = [context] * batch
        n = sum(lengths)
        k, v, q, one, lens = decode_inputs(batch, context, 5)
        cq = cu([1] * batch)
        cells, unpacked = [], []
        for dtype, runs in (("auto", ((0, 1), (1, 1))), ("fp8", ((0, 1), (1, 1), (1, floor)))):
            kc, vc, table = paged_cache(k, v, lengths, 16, one, one, dtype=dtype, shuffle=False)
            qq = ops.scaled_fp8_quant(q.reshape(batch, -1), one)[0].view(batch, H, D) if dtype == "fp8" else q
            d = (one, one, one) if dtype == "fp8" else None
            gb = n * HK * D * 2 * (1 if dtype == "fp8" else 2) / 1e9
            for splits, mq in runs:
                ms = timed(lambda: fa(qq, kc, vc, cq, mq, lens, context, table, d, num_splits=splits))
                cells.append((ms, gb / ms))
            pinned = runs[-1][1]
            try:  # the pinned launch without GQA packing: its time, and whether its bytes are the packed launch's
                packed = fa(qq, kc, vc, cq, pinned, lens, context, table, d)
                differ = int((fa3_unpacked(qq, kc, vc, cq, pinned, lens, context, table, d) != packed).sum())
                ms = timed(lambda: fa3_unpacked(qq, kc, vc, cq, pinned, lens, context, table, d))
                unpacked.append(f"{ms:.3f} ({gb / ms:.2f}; {differ})")
            except (RuntimeError, TypeError) as e:  # another op signature: say so, keep the rest
                unpacked.append(f"n/a ({str(e).splitlines()[0][:80]})")
            del kc, vc
        row = " | ".join(f"{ms:.3f} ({rate:.2f})" for ms, rate in cells)
        print(f"  {batch} | {row} | {cells[1][0] / cells[4][0]:.2f}x | {' , '.join(unpacked)}")


def pages(context: int = 4160, batch: int = 32, sizes=(16, 64, 224, 448), floors=(17, 33, 65)):
    """FA3's FP8 decode by the cache's page size and the launch's `max_seqlen_q`: FA3 loads a paged K/V with TMA only
    where `page % kBlockN == 0` and `max_seqlen_q * heads / kv_heads > kBlockM`, otherwise row by row. Per page size
    and floor: ms (cache TB/s) of one decode step at `batch` x `context` with one split, and the elements in which a
    paged decode (five positions of three sequences) differs from the actor's contiguous causal forward."""
    print(f"== pages: FP8 decode, one split, {batch} x ctx {context}: ms (TB/s) / elements differing from the actor's forward")
    g = torch.Generator(device=dev).manual_seed(6)
    n = batch * context
    k, v, q, one, lens = decode_inputs(batch, context, 6)
    qq = ops.scaled_fp8_quant(q.reshape(batch, -1), one)[0].view(batch, H, D)
    gb = n * HK * D * 2 / 1e9
    cq1 = cu([1] * batch)  # made once: a host-to-device copy inside the timed call would be timed too
    # the bytes: three sequences, the actor's call (contiguous K/V, whole sequences) against paged decodes
    lengths = [700, 1500, 2048]
    m = sum(lengths)
    _, ks_, vs_, sc, q8 = fp8_inputs(m, g)
    cq = cu(lengths)
    k8 = (ks_.float() / sc[1]).clamp(-448, 448).to(E4M3)
    v8 = (vs_.float() / sc[2]).clamp(-448, 448).to(E4M3)
    whole = fa(q8, k8, v8, cq, max(lengths), None, max(lengths), None, sc, cu_k=cq)
    starts = cq[:-1].tolist()
    print("  page | " + " | ".join(f"max_q {f}" for f in floors) + " | heuristic splits, max_q 1")
    for page in sizes:
        kc, vc, table = paged_cache(k, v, [context] * batch, page, one, one, shuffle=False)
        kb, vb, tb = paged_cache(ks_, vs_, lengths, page, sc[1], sc[2])
        cells = []
        for floor in floors:
            ms = timed(lambda: fa(qq, kc, vc, cq1, floor, lens, context, table, (one, one, one)))
            differ = 0
            for back in (1, 2, 7, 100, 513):
                pos = [x - back for x in lengths]
                qd = torch.stack([q8[s + p] for s, p in zip(starts, pos)])
                used = torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=dev)
                d = fa(qd, kb, vb, cu([1] * 3), floor, used, max(pos) + 1, tb, sc)
                differ += int((d != torch.stack([whole[s + p] for s, p in zip(starts, pos)])).sum())
            cells.append(f"{ms:.3f} ({gb / ms:.2f}) / {differ}")
        ms = timed(lambda: fa(qq, kc, vc, cq1, 1, lens, context, table, (one, one, one), num_splits=0))
        print(f"  {page} | " + " | ".join(cells) + f" | {ms:.3f} ({gb / ms:.2f})")
        del kc, vc, kb, vb


def pieces(lengths=(700, 1500, 2048), piece: int = 16):
    """The actor's causal forward as pieces of `piece` queries each (every piece a sequence of its own over the cache up to
    its last query), launched at `max_seqlen_q` = piece so FA3 keeps its one-warpgroup kernel, against the engine's
    unpinned paged decode (max_seqlen_q 1): elements differing, and the pieces' time against the whole forward's."""
    g = torch.Generator(device=dev).manual_seed(7)
    m = sum(lengths)
    _, k, v, sc, q8 = fp8_inputs(m, g)
    kc, vc, table = paged_cache(k, v, list(lengths), 16, sc[1], sc[2])
    starts = cu(list(lengths))[:-1].tolist()
    rows, ends, seqs = [], [], []
    for i, (s0, n) in enumerate(zip(starts, lengths)):
        for a in range(0, n, piece):
            b = min(a + piece, n)
            rows.append(torch.arange(s0 + a, s0 + b, device=dev))
            ends.append(b)
            seqs.append(i)
    qp = q8[torch.cat(rows)]  # the pieces in token order: row i of their output is token i
    cqp = cu([len(r) for r in rows])
    used = torch.tensor(ends, dtype=torch.int32, device=dev)
    tp = table[torch.tensor(seqs, device=dev)].contiguous()
    out = fa(qp, kc, vc, cqp, piece, used, max(lengths), tp, sc)
    lens = torch.tensor(list(lengths), dtype=torch.int32, device=dev)
    cq = cu(list(lengths))  # made once: a host-to-device copy inside the timed call would be timed too
    whole = fa(q8, kc, vc, cq, max(lengths), lens, max(lengths), table, sc)
    differ = {"pieces vs decode": 0, "whole (two warpgroups) vs decode": 0}
    for back in (1, 2, 7, 100, 513):
        pos = [x - back for x in lengths]
        qd = torch.stack([q8[s + p] for s, p in zip(starts, pos)])
        d = fa(
            qd,
            kc,
            vc,
            cu([1] * len(lengths)),
            1,
            torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=dev),
            max(pos) + 1,
            table,
            sc,
        )
        idx = torch.tensor([s + p for s, p in zip(starts, pos)], device=dev)
        differ["pieces vs decode"] += int((out[idx] != d).sum())
        differ["whole (two warpgroups) vs decode"] += int((whole[idx] != d).sum())
    t_p = timed(lambda: fa(qp, kc, vc, cqp, piece, used, max(lengths), tp, sc))
    t_w = timed(lambda: fa(q8, kc, vc, cq, max(lengths), lens, max(lengths), table, sc))
    print(
        f"== pieces of {piece} queries (one warpgroup) vs decode at max_seqlen_q 1: {differ}; ms pieces {t_p:.3f}, whole {t_w:.3f}"
    )


def aot(context: int = 4160, batches=(32, 64, 128)):
    """vLLM's engine launches FA3 with scheduler metadata made ahead of time, once a step for every layer
    (`get_scheduler_metadata` in the metadata builder), except in batch-invariant mode, which the one-split pin borrows:
    each launch then prepares its own schedule. The other sections launch without it. Per batch at the decode shape:
    ms per layer's launch without and with the metadata (its making timed apart: once a step), unpinned (FA3's
    splits) and pinned (one split; FP8 with the launch floor, the metadata made for the floored launch), and the
    elements in which the pinned launch with metadata differs from the one without (0: the pins could keep it)."""
    floor = fp8_attention_min_q(H, HK)
    print(f"== aot: decode at context {context}, ms per launch without / with ahead-of-time scheduler metadata")
    print("  batch | cache | splits: without, with | pins: without, with, elements differing | making the metadata")
    for batch in batches:
        k, v, q, one, lens = decode_inputs(batch, context, 7)
        cq = cu([1] * batch)
        for dtype in ("auto", "fp8"):
            kc, vc, table = paged_cache(k, v, [context] * batch, 16, one, one, dtype=dtype, shuffle=False)
            fp8 = dtype == "fp8"
            qq = ops.scaled_fp8_quant(q.reshape(batch, -1), one)[0].view(batch, H, D) if fp8 else q
            d = (one, one, one) if fp8 else None
            pinned_q = floor if fp8 else 1

            def meta(max_q, splits):
                return get_scheduler_metadata(
                    batch, max_q, context, H, HK, D, lens, qkv_dtype=E4M3 if fp8 else torch.bfloat16,
                    cu_seqlens_q=cq, page_size=16, causal=True, num_splits=splits,
                )  # fmt: skip

            cells = []
            for max_q, splits in ((1, 0), (pinned_q, 1)):
                m = meta(max_q, splits)
                without = timed(lambda: fa(qq, kc, vc, cq, max_q, lens, context, table, d, num_splits=splits))
                with_meta = timed(lambda: fa(qq, kc, vc, cq, max_q, lens, context, table, d, num_splits=splits, meta=m))
                cells.append(f"{without:.3f}, {with_meta:.3f}")
            m = meta(pinned_q, 1)
            differ = int(
                (
                    fa(qq, kc, vc, cq, pinned_q, lens, context, table, d, meta=m)
                    != fa(qq, kc, vc, cq, pinned_q, lens, context, table, d)
                ).sum()
            )
            making = timed(lambda: meta(pinned_q, 1))
            print(f"  {batch} | {'fp8' if fp8 else 'bf16'} | {cells[0]} | {cells[1]}, {differ} | {making:.3f}")
            del kc, vc


SECTIONS = ("quant", "bytes", "backward", "speed", "decode", "pages", "pieces", "aot")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    sections = ap.parse_args().sections
    print(torch.cuda.get_device_name())
    if "quant" in sections:
        quantizers()
    if "bytes" in sections:
        print("== FP8 FA3 bytes: actor-side calls against the engine's (elements differing)")
        for lengths, page, chunk in (([700, 1500, 2048], 16, 512), ([4096, 777, 1200], 16, 1000), ([2100, 640, 900], 64, 128)):
            print(f"  lengths {lengths} page {page} chunk {chunk}: {equality(lengths, page, chunk)}")
    if "backward" in sections:
        print("== backward (relative norm error)")
        backward()
    if "speed" in sections:
        speed()
    if "decode" in sections:
        decode_pins()
    if "pages" in sections:
        pages()
    if "pieces" in sections:
        pieces()
    if "aot" in sections:
        aot()
