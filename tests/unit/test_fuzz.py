"""Property / fuzz tests on hostile input (RELIABILITY.md, "fuzzing"): the config loader, the checkpoint readers
(actor shards + meta.json, HF safetensors + index, the export manifest) and the FP8 quantizer's entry points.

The contracts each property states:
* config: anything a user can write either loads or raises `ConfigError` -- never another exception;
* readers: any change to a checkpoint's bytes (bit flip, truncation, extension) is refused by the sha256
  manifest; what the readers return for valid files is exactly what was written;
* quantizer: on any finite input of any accepted shape/dtype/layout the bytes are within E4M3 rounding of the
  input, scales are finite and positive, and layout does not change the bytes; NaN/inf are refused naming the
  first bad element; a bad argument is a ValueError/TypeError.

Properties marked xfail(strict=True) are defects (RELIABILITY.md, "open defects") that hypothesis finds today;
each fails loudly (XPASS) once fixed, so that the mark is removed.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from megatron_jetrl.convert.hf_writer import verify_manifest, write_safetensors
from megatron_jetrl.fp8.quant import BLOCKS, E4M3_MAX, NonFiniteInputError, dequantize_blockwise, quantize_blockwise, scale_shape
from megatron_jetrl.models.shards import CheckpointError, ShardedCheckpoint, save_rank_shard, write_meta
from megatron_jetrl.rl.config import ConfigError, JetRLConfig, config_from_dict, load_config
from megatron_jetrl.rollout.native import read_hf_checkpoint

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FAST = settings(FUZZ, max_examples=25)

# ---- the config loader ------------------------------------------------------------------------------------

SECTIONS = {
    "run": ["name", "out_dir", "seed", "steps", "save_every", "resume", "export", "device", "timeout_s", "on_nonfinite"],
    "parallel": ["tp", "pp", "dp"],
    "precision": ["mode", "scale_mode", "eps", "backend"],
    "rollout": ["engine", "num_engines", "n", "temperature", "top_p", "max_new_tokens", "bucket_mb"],
    "grpo": ["prompts_per_step", "micro_batch_size", "updates_per_step", "advantage_scale"],
    "loss": ["clip_low", "clip_high", "kl_coef", "kl_estimator"],
    "optim": ["lr", "weight_decay", "clip_grad", "bf16"],
    "warmup": ["steps", "lr", "batch_size"],
    "data": ["source", "path", "template", "reward_style", "operand_max"],
    "model": ["tokenizer", "batch_invariant", "path"],
}
scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 3, 4, 8, 16, 64, 128]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["jetrl", "bf16", "ue8m0", "fp32", "auto", "cpu", "stop", "skip", "native", "std", "k3", "arithmetic"]),
)
value = st.recursive(
    scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def config_dicts(draw):
    out = {}
    for section in draw(st.lists(st.sampled_from([*SECTIONS, "bogus", "Run"]), max_size=5, unique=True)):
        keys = SECTIONS.get(section, ["x"]) + ["typo_key"]
        chosen = draw(st.lists(st.sampled_from(keys), max_size=4, unique=True))
        out[section] = (
            draw(st.one_of(st.just({k: draw(value) for k in chosen}), value))
            if draw(st.integers(0, 9)) == 0
            else {k: draw(value) for k in chosen}
        )
    return out


@FUZZ
@given(config_dicts())
def test_config_dict_loads_or_raises_config_error(data):
    """Random sections, known and misspelled keys, values of every type (NaN, inf, 2**70, nested lists, ...)."""
    try:
        cfg = config_from_dict(data)
    except ConfigError as e:
        assert str(e)
        return
    assert isinstance(cfg, JetRLConfig)
    cfg.to_dict()  # an accepted config can be written into a checkpoint's trainer_state


def _yaml_parses(raw: str) -> bool:
    import yaml

    try:
        yaml.safe_load(raw)
    except yaml.YAMLError:
        return False
    return True


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.sampled_from([f"{s}.{k}" for s, ks in SECTIONS.items() for k in ks] + ["run", "x.y", "run.", ".a"]),
            st.text(max_size=10),
        ),
        max_size=4,
    )
)
def test_overrides_load_or_raise_config_error(pairs):
    """`section.key=value` overrides with arbitrary values that YAML can read (values are read as YAML; the
    ones it cannot read are defect D8, below)."""
    assume(all(_yaml_parses(v) for _, v in pairs))
    try:
        load_config(None, [f"{k}={v}" for k, v in pairs])
    except ConfigError:
        pass


@FAST
@given(st.sampled_from(["[", "{a", "a: b: c", '"open', "*alias", "!!python/object:os.system x", "- a\n b"]))
def test_override_values_that_are_not_yaml_are_config_errors(raw):
    with pytest.raises(ConfigError):
        load_config(None, [f"run.name={raw}"])


@FAST
@given(
    st.fixed_dictionaries(
        {
            "model_type": st.sampled_from(["qwen2", "qwen3", "llama"]),
            "hidden_size": st.sampled_from([0, 128, 256, -256]),
            "intermediate_size": st.sampled_from([0, 128, 512]),
            "num_hidden_layers": st.integers(-1, 3),
            "num_attention_heads": st.integers(0, 4),
            "num_key_value_heads": st.integers(0, 4),
            "head_dim": st.sampled_from([None, 0, 64, 128]),
            "vocab_size": st.integers(-1, 512),
        }
    )
)
def test_hostile_architecture_is_a_config_error(hf):
    try:
        config_from_dict({"model": {"hf_config": hf}})
    except ConfigError:
        pass


@FUZZ
@given(st.text(max_size=200))
@example("?")  # a YAML mapping whose key is null (found by this test: TypeError in the "did you mean" hint)
@example("1: {}")
def test_yaml_file_of_any_text_loads_or_raises_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text)
    try:
        load_config(str(path))
    except ConfigError:
        pass


# ---- the checkpoint readers -------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64, torch.uint8]


@st.composite
def tensor_sets(draw):
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_.]{0,20}", fullmatch=True), min_size=1, max_size=4, unique=True))
    out = {}
    for name in names:
        shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        raw = torch.randint(
            0, 256, (math.prod(shape) * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g
        )
        t = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
        if dtype.is_floating_point:
            t = torch.where(torch.isfinite(t.float()), t, torch.zeros((), dtype=dtype)) if t.numel() else t
        out[name] = t
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    )


@FAST
@given(tensor_sets(), st.booleans())
def test_hf_reader_returns_exactly_what_was_written(tmp_path_factory, tensors, sharded):
    d = tmp_path_factory.mktemp("hf")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    if sharded:
        names = sorted(tensors)
        files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, part in files.items():
            write_safetensors(d / file, [(n, tensors[n]) for n in part])
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: f for f, p in files.items() for n in p}}))
    else:
        write_safetensors(d / "model.safetensors", list(tensors.items()))
    config, got = read_hf_checkpoint(d)
    assert config == {"model_type": "qwen2"} and set(got) == set(tensors)
    assert all(same(got[n], tensors[n]) for n in tensors)


def _one_shard_checkpoint(d: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    entry = save_rank_shard(d, {"w": torch.randn(16, 8, generator=g).bfloat16(), "b": torch.randn(8, generator=g)}, 0, 0)
    write_meta(d, iteration=1, tp=1, pp=1, spec="local", hf_config={"model_type": "qwen2"}, flow={}, shards=[entry])
    return d / entry["file"]


mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**9), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 10**9), st.just(0)),
    st.tuples(st.just("append"), st.integers(1, 64), st.just(0)),
)


def mutate(path: Path, how) -> None:
    kind, where, bit = how
    data = bytearray(path.read_bytes())
    if kind == "flip":
        data[where % len(data)] ^= 1 << bit
    elif kind == "truncate":
        data = data[: where % len(data)]
    else:
        data += bytes(where)
    path.write_bytes(bytes(data))


@FUZZ
@given(mutations)
@example(("flip", 0, 0))  # the header length
def test_any_changed_shard_byte_is_refused_by_the_manifest(tmp_path_factory, how):
    shard = _one_shard_checkpoint(tmp_path_factory.mktemp("ck"))
    mutate(shard, how)
    with pytest.raises(CheckpointError, match=r"tp00_pp000.safetensors: .*(sha256 differs|truncated or replaced)"):
        ShardedCheckpoint.open(shard.parent, verify=True)


@FAST
@given(mutations, st.sampled_from(["model-00001-of-00001.safetensors", "config.json", "model.safetensors.index.json"]))
def test_any_changed_export_file_is_reported_by_verify_manifest(tmp_path_factory, how, victim):
    from megatron_jetrl.convert.hf_writer import HFCheckpointWriter

    out = tmp_path_factory.mktemp("ex") / "out"
    w = HFCheckpointWriter(out)
    w.add("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))
    w.write_json("config.json", {"model_type": "qwen2"})
    w.finish()
    assert verify_manifest(out) == []
    mutate(out / victim, how)
    problems = verify_manifest(out)
    assert len(problems) == 1 and problems[0].startswith(victim), problems


meta_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["format", "tp", "pp", "shards", "file", "bytes", "sha256", "spec"]), inner, max_size=4),
    ),
    max_leaves=8,
)


@FAST
@given(meta_values)
def test_hostile_meta_json_is_a_checkpoint_error(tmp_path_factory, meta):
    d = tmp_path_factory.mktemp("meta")
    (d / "meta.json").write_text(
        json.dumps({"format": "megatron-jetrl-shards/1", "shards": meta} if isinstance(meta, list) else meta)
    )
    try:
        ShardedCheckpoint.open(d, verify=True)
    except CheckpointError:
        pass


@st.composite
def hostile_safetensors(draw):
    """A safetensors file whose header lies: bad lengths, JSON, dtypes, shapes, offsets."""
    kind = draw(st.sampled_from(["length", "json", "entry"]))
    if kind == "length":
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + draw(st.binary(max_size=32))
    if kind == "json":
        body = draw(st.binary(max_size=40))
        return struct.pack("<Q", len(body)) + body
    entry = {
        "dtype": draw(st.sampled_from(["F32", "BF16", "F8_E4M3", "Q7", "", 5])),
        "shape": draw(st.lists(st.integers(-2, 6), max_size=3)),
        "data_offsets": draw(st.lists(st.integers(-4, 200), min_size=0, max_size=3)),
    }
    data = draw(st.integers(0, 64))
    assume(not _honest(entry, data))  # e.g. F32, shape [0], offsets [0, 0] is a valid empty tensor
    header = json.dumps({"t": entry}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(data)


def _honest(entry, data_bytes):
    """Whether a header entry describes exactly the bytes that follow (then the file is valid, not hostile)."""
    size = {"F32": 4, "BF16": 2, "F8_E4M3": 1}.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    offsets, shape = entry["data_offsets"], entry["shape"]
    if size is None or len(offsets) != 2 or min(shape, default=0) < 0:
        return False
    return offsets[0] == 0 and offsets[1] == data_bytes == math.prod(shape) * size


@FUZZ
@given(hostile_safetensors())
def test_lying_safetensors_header_never_yields_tensors(tmp_path_factory, raw):
    """A header that lies about its tensor is refused (by safetensors itself, today: SafetensorError)."""
    d = tmp_path_factory.mktemp("st")
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(raw)
    try:
        _, tensors = read_hf_checkpoint(d)
    except Exception:  # noqa: BLE001 - any refusal; the type is the strict-xfail property below
        return
    t = tensors["t"]  # accepted: then it must be exactly the bytes the header describes
    assert t.numel() * t.element_size() <= len(raw)


@FAST
@given(
    st.one_of(
        hostile_safetensors().map(lambda raw: ("model.safetensors", raw, None)),
        meta_values.map(lambda v: ("model.safetensors.index.json", json.dumps(v).encode(), None)),
        st.sampled_from(["../outside.safetensors", "/etc/hostname"]).map(
            lambda p: ("model.safetensors.index.json", json.dumps({"weight_map": {"t": p}}).encode(), p)
        ),
    )
)
def test_hostile_hf_checkpoint_is_a_value_error_naming_the_file(tmp_path_factory, case):
    name, raw, outside = case
    root = tmp_path_factory.mktemp("hf")
    save_file({"t": torch.zeros(2)}, str(root / "outside.safetensors"))
    d = root / "ck"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / name).write_bytes(raw)
    with pytest.raises((ValueError, OSError)) as e:
        read_hf_checkpoint(d)
    assert str(d) in str(e.value)


# ---- the quantizer ----------------------------------------------------------------------------------------

FINITE = {torch.float32: 3.0e38, torch.bfloat16: 3.0e38, torch.float16: 65000.0}


@st.composite
def quant_inputs(draw):
    dtype = draw(st.sampled_from(list(FINITE)))
    block = draw(st.sampled_from(BLOCKS))
    one_d = block == (1, 128) and draw(st.booleans())
    shape = (
        [draw(st.integers(0, 300))]
        if one_d
        else [*([draw(st.integers(1, 2))] if draw(st.booleans()) else []), draw(st.integers(0, 260)), draw(st.integers(0, 260))]
    )
    n = math.prod(shape)
    scale = draw(st.sampled_from([1.0, 1e-30, 1e-8, 1e4, FINITE[dtype] / 4]))
    seed = draw(st.integers(0, 2**31))
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).clamp(-FINITE[dtype], FINITE[dtype])
    specials = draw(
        st.lists(
            st.tuples(st.integers(0, max(n - 1, 0)), st.sampled_from([0.0, -0.0, 1e-45, -1e-40, FINITE[dtype], -FINITE[dtype]])),
            max_size=4,
        )
    )
    for i, v in specials:
        if n:
            x[i] = v
    x = x.to(dtype).reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"])) if len(shape) >= 2 else "contiguous"
    if layout == "transposed":
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "sliced":
        x = torch.cat([x, x], dim=-1)[..., : shape[-1]]
    return x, block, draw(st.sampled_from(["fp32", "ue8m0"]))


@settings(FUZZ, max_examples=80)
@given(quant_inputs())
def test_quantizer_on_any_finite_input(case):
    x, block, scale_mode = case
    q, s = quantize_blockwise(x, block, scale_mode)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == tuple(x.shape)
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(x.shape, block)
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())
    assert not bool(torch.isnan(q.float()).any()) and bool((q.float().abs() <= E4M3_MAX).all())
    # within E4M3 rounding: relative 2^-4 for normal values, 2^-10 * s below the smallest normal (2^-6 * s)
    back = dequantize_blockwise(q, s, block)
    xf = x.float()
    if back.dim() == 1:
        per = s.repeat_interleave(block[1])[: xf.shape[0]]
    else:
        per = s.repeat_interleave(block[0], dim=-2)[..., : xf.shape[-2], :].repeat_interleave(block[1], dim=-1)[
            ..., : xf.shape[-1]
        ]
    err = (back - xf).abs()
    bound = torch.maximum(xf.abs() * 2.0**-4, per * 2.0**-10) * (1 + 2.0**-20)
    assert bool((err <= bound).all()), float((err - bound).max())
    # the layout of x does not change a byte
    q2, s2 = quantize_blockwise(x.contiguous(), block, scale_mode)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


@FUZZ
@given(quant_inputs(), st.sampled_from([math.nan, math.inf, -math.inf]), st.integers(0, 10**9))
def test_quantizer_refuses_nan_inf_naming_the_first_element(case, bad, where):
    x, block, scale_mode = case
    assume(x.numel() > 0)
    x = x.clone()
    flat = x.view(-1) if x.is_contiguous() else None
    assume(flat is not None)
    flat[where % x.numel()] = bad
    first = tuple(int(i) for i in (~torch.isfinite(x)).nonzero()[0])
    with pytest.raises(
        NonFiniteInputError,
        match=rf"got {'nan' if math.isnan(bad) else ('-' if bad < 0 else '') + 'inf'} at index {re_tuple(first)}",
    ):
        quantize_blockwise(x, block, scale_mode)


def re_tuple(t: tuple) -> str:
    return "\\(" + ", ".join(map(str, t)) + ("," if len(t) == 1 else "") + "\\)"


@FAST
@given(
    st.one_of(
        st.tuples(st.just("block"), st.sampled_from([(1, 64), (64, 64), (128,), (1, 128, 1), (0, 0), (-1, 128)])),
        st.tuples(st.just("dtype"), st.sampled_from([torch.float64, torch.int32, torch.uint8, torch.bool, torch.float8_e4m3fn])),
        st.tuples(st.just("scale_mode"), st.sampled_from(["e8m0", "", "FP32", "ue8m0 "])),
    )
)
def test_quantizer_refuses_bad_arguments(case):
    what, bad = case
    x = torch.randn(4, 256)
    kwargs = {"block": (1, 128), "scale_mode": "fp32"}
    if what == "dtype":
        x = x.to(bad)
    else:
        kwargs[what] = bad
    with pytest.raises((ValueError, TypeError), match=r"block must be one of|quantize_blockwise takes|scale_mode must be one of"):
        quantize_blockwise(x, kwargs["block"], kwargs["scale_mode"])


@FAST
@given(st.sampled_from([0.0, -1.0, math.nan, -math.inf]))
def test_quantizer_refuses_a_bad_eps(eps):
    with pytest.raises(ValueError):
        quantize_blockwise(torch.zeros(2, 128), (1, 128), eps=eps)
