"""Checkpoint converter: actor TP x PP shards -> HF FP8 block / BF16 safetensors, and its verifier."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_jetrl.convert import ConversionError, HFCheckpointWriter, OutputExistsError, convert, verify_manifest
from megatron_jetrl.convert.hf_writer import INDEX_NAME, MANIFEST_NAME, parse_size
from megatron_jetrl.convert.synthetic import save_synthetic_checkpoint, tiny_config
from megatron_jetrl.convert.verify import verify_checkpoint
from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight, quantize_blockwise
from megatron_jetrl.models import ModelArch, model_entries
from megatron_jetrl.models.mapping import from_hf, padded_vocab_size, rank_slice
from megatron_jetrl.models.shards import ShardedCheckpoint

REPO = Path(__file__).resolve().parents[2]
SHARD_CAP = "600KB"  # the tiny FP8 model is ~1.9 MB: several shards


def load_dir(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / INDEX_NAME).read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        with safe_open(directory / file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert out.keys() == index.keys()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def shard_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("model-*.safetensors"))}


def leftovers(tmp_path: Path, name: str) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(name))


@pytest.fixture(scope="module")
def qwen2_tp2pp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("q2")
    hf = save_synthetic_checkpoint(d / "ckpt", tiny_config("qwen2"), tp=2, pp=2, seed=3)
    convert(d / "ckpt", d / "fp8", max_shard_size=SHARD_CAP)
    convert(d / "ckpt", d / "bf16", dtype="bf16")
    return d, hf


# -- format ------------------------------------------------------------------------------------
def test_fp8_format_config_dtypes_shapes_index_manifest(qwen2_tp2pp2):
    d, hf = qwen2_tp2pp2
    out = d / "fp8"
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert (out / "generation_config.json").is_file()
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert all((out / f).stat().st_size <= parse_size(SHARD_CAP) + 8192 for f in files)  # cap on data; header extra
    tensors = load_dir(out)
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    linears = [n for n in hf if n.endswith("_proj.weight")]
    assert len(linears) == 7 * 2
    for name, ref in hf.items():
        if name in linears:
            q, s = tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and q.shape == ref.shape
            assert s.dtype == torch.float32 and s.shape == (-(-ref.shape[0] // 128), -(-ref.shape[1] // 128))
        else:  # embeddings, lm_head, norms, q/k/v biases: BF16, unchanged
            assert tensors[name].dtype == torch.bfloat16 and torch.equal(bits(tensors[name]), bits(ref)), name
    assert set(tensors) == set(hf) | {n.removesuffix("weight") + "weight_scale_inv" for n in linears}
    assert verify_manifest(out) == []
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert {f["file"] for f in manifest["files"]} == set(os.listdir(out)) - {MANIFEST_NAME}
    assert manifest["source"]["tp"] == 2 and manifest["source"]["pp"] == 2


def test_bf16_export_is_the_model_bit_for_bit(qwen2_tp2pp2):
    d, hf = qwen2_tp2pp2
    assert "quantization_config" not in json.loads((d / "bf16" / "config.json").read_text())
    tensors = load_dir(d / "bf16")
    assert tensors.keys() == hf.keys()
    assert all(torch.equal(bits(tensors[n]), bits(hf[n])) for n in hf)


# -- one code path: the trainer's bytes -----------------------------------------------------------
@pytest.mark.parametrize("scale_mode", ["fp32", "ue8m0"])
def test_exported_fp8_bytes_are_the_trainer_forward_bytes(tmp_path, scale_mode, monkeypatch):
    """Each TP rank's QuantizedWeight.quantize (what the trainer's FP8 forward uses) is, byte for byte,
    that rank's slice of the exported weight and scale grid; and the export is the full tensor's quantization.
    The converter quantizes in slices of 128 rows here (its memory-saving path) against whole-shard calls."""
    from megatron_jetrl.convert import converter

    monkeypatch.setattr(converter, "QUANT_ROWS", 128)
    config, tp = tiny_config("qwen3"), 2
    flow = PrecisionFlow(mode="jetrl", scale_mode=scale_mode)
    hf = save_synthetic_checkpoint(tmp_path / "ckpt", config, tp=tp, flow=flow, seed=11)
    convert(tmp_path / "ckpt", tmp_path / "out")
    out = load_dir(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"].get("scale_fmt") == (
        "ue8m0" if scale_mode == "ue8m0" else None
    )
    arch = ModelArch.from_hf_config(config)
    ckpt = ShardedCheckpoint.open(tmp_path / "ckpt")
    fetch = ckpt.fetch(0)
    padded = padded_vocab_size(arch.vocab_size, tp)
    checked = 0
    for e in model_entries(arch):
        if not e.fp8:
            continue
        for r, shard in enumerate(fetch(e.megatron)):
            trainer = QuantizedWeight.quantize(shard, flow)  # the forward's FP8 weight on TP rank r
            q_exp = from_hf(e, arch, {n: rank_slice(e, bits(out[n]), r, tp, padded) for n in e.hf})
            s_exp = from_hf(
                e,
                arch,
                {n: rank_slice(e, out[n.removesuffix("weight") + "weight_scale_inv"], r, tp, padded) for n in e.hf},
                unit=128,
            )
            assert torch.equal(q_exp, bits(trainer.q)) and torch.equal(s_exp, trainer.s), (e.megatron, r)
            checked += 1
        for n in e.hf:
            q, s = quantize_blockwise(hf[n], (128, 128), scale_mode)
            assert torch.equal(bits(out[n]), bits(q)) and torch.equal(out[n.removesuffix("weight") + "weight_scale_inv"], s)
    assert checked == 4 * arch.num_layers * tp


# -- TP / PP invariance ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_tp_and_pp_layouts_convert_to_identical_files(tmp_path, family):
    hf = None
    outputs = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        ck = tmp_path / f"ck_tp{tp}pp{pp}"
        hf = save_synthetic_checkpoint(ck, tiny_config(family), tp=tp, pp=pp, seed=5, hf_state=hf)
        convert(ck, tmp_path / f"out_tp{tp}pp{pp}", max_shard_size=SHARD_CAP)
        outputs[(tp, pp)] = tmp_path / f"out_tp{tp}pp{pp}"
    ref = shard_files(outputs[(1, 1)])
    ref_index = (outputs[(1, 1)] / INDEX_NAME).read_text()
    for key, out in outputs.items():
        assert shard_files(out) == ref, key  # identical bytes, file by file
        assert (out / INDEX_NAME).read_text() == ref_index


def test_uneven_pipeline_splits_convert_to_the_same_files(tmp_path):
    """`parallel.pp_last_layers`: the checkpoint records the split and the converter reads each stage's layers from
    it; every split of the same weights exports the same bytes as PP 1."""
    config, hf, outputs = tiny_config("qwen3", num_hidden_layers=4), None, {}
    for pp, last in ((1, 0), (2, 0), (2, 1), (2, 3), (3, 2), (4, 0)):
        ck = tmp_path / f"ck_pp{pp}_{last}"
        hf = save_synthetic_checkpoint(ck, config, tp=2, pp=pp, seed=7, hf_state=hf, pp_last_layers=last)
        assert json.loads((ck / "meta.json").read_text()).get("pp_last_layers", 0) == last
        convert(ck, tmp_path / f"out_pp{pp}_{last}", max_shard_size=SHARD_CAP)
        outputs[(pp, last)] = shard_files(tmp_path / f"out_pp{pp}_{last}")
    layers = {
        (pp, last): [
            e.megatron
            for e in model_entries(ModelArch.from_hf_config(config), pp_rank=pp - 1, pp_size=pp, last_layers=last)
            if ".layers." in e.megatron
        ]
        for pp, last in outputs
    }
    assert len(layers[(2, 1)]) == len(layers[(2, 0)]) // 2 and len(layers[(2, 3)]) == 3 * len(layers[(2, 1)])
    assert all(out == outputs[(1, 0)] for out in outputs.values())


# -- safety -----------------------------------------------------------------------------------------
def test_refuses_existing_output_without_force_and_replaces_with_force(qwen2_tp2pp2, tmp_path):
    d, _ = qwen2_tp2pp2
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match="exists; pass --force"):
        convert(d / "ckpt", out)
    assert os.listdir(out) == ["keep.txt"]
    with pytest.raises(OutputExistsError):
        HFCheckpointWriter(out)
    convert(d / "ckpt", out, force=True)
    assert not (out / "keep.txt").exists() and verify_manifest(out) == []
    assert leftovers(tmp_path, "out") == ["out"]


def test_error_mid_conversion_leaves_nothing(qwen2_tp2pp2, tmp_path, monkeypatch):
    d, _ = qwen2_tp2pp2
    calls = {"n": 0}
    original = HFCheckpointWriter.add

    def failing_add(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 30:
            raise OSError("disk full (simulated)")
        return original(self, name, tensor)

    monkeypatch.setattr(HFCheckpointWriter, "add", failing_add)
    with pytest.raises(OSError, match="disk full"):
        convert(d / "ckpt", tmp_path / "out", max_shard_size="100KB")
    assert leftovers(tmp_path, "out") == []


def test_killed_conversion_never_looks_complete(qwen2_tp2pp2, tmp_path):
    """SIGKILL after some shards were written: no <out>, only an <out>.partial-<pid> without an index."""
    d, _ = qwen2_tp2pp2
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
from megatron_jetrl.convert import hf_writer, convert
original = hf_writer.HFCheckpointWriter._flush
def flush(self):
    original(self)
    if len(self._shards) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
hf_writer.HFCheckpointWriter._flush = flush
convert({str(d / "ckpt")!r}, {str(tmp_path / "out")!r}, max_shard_size="300KB")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    left = leftovers(tmp_path, "out")
    assert len(left) == 1 and left[0].startswith("out.partial-")
    assert sorted(os.listdir(tmp_path / left[0])) == ["shard-00001.safetensors", "shard-00002.safetensors"]


def test_a_writer_removes_staging_left_by_dead_writers(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    for pid in (gone.pid, os.getppid()):  # a killed conversion's, a running one's
        (tmp_path / f"out.partial-{pid}").mkdir()
        (tmp_path / f"out.partial-{pid}" / "shard-00001.safetensors").write_bytes(b"x")
    writer = HFCheckpointWriter(tmp_path / "out")
    writer.add("w", torch.zeros(2))
    writer.finish()
    assert leftovers(tmp_path, "out") == ["out", f"out.partial-{os.getppid()}"]


# -- bad input --------------------------------------------------------------------------------------
def _edit_meta(ck: Path, **changes):
    meta = json.loads((ck / "meta.json").read_text())
    for k, v in changes.items():
        if callable(v):
            meta[k] = v(meta[k])
        else:
            meta[k] = v
    (ck / "meta.json").write_text(json.dumps(meta))


def _corrupt(ck: Path):
    path = ck / "tp01_pp000.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


BAD_INPUTS = {
    "wrong family": (
        dict(tp=2),
        lambda ck: _edit_meta(ck, hf_config=lambda c: {**c, "model_type": "mistral"}),
        r"model_type='mistral'.*supports",
    ),
    "no meta": (dict(tp=2), lambda ck: (ck / "meta.json").unlink(), r"no meta.json"),
    "missing shard": (
        dict(tp=2),
        lambda ck: (ck / "tp01_pp000.safetensors").unlink(),
        r"shard tp01_pp000.safetensors is missing",
    ),
    "corrupt shard": (dict(tp=2), _corrupt, r"sha256 differs"),
    "truncated shard": (dict(tp=2), lambda ck: os.truncate(ck / "tp01_pp000.safetensors", 1000), r"truncated"),
    "tp says 1, shards are tp2": (
        dict(tp=2),
        lambda ck: _edit_meta(ck, tp=1, shards=lambda s: [x for x in s if x["file"].startswith("tp00")]),
        r"embedding.word_embeddings.weight has shape \[256, 256\], but TP rank 0 of TP=1 holds \[384, 256\].*disagree",
    ),
    "pp says 1, shards are pp2": (
        dict(pp=2),
        lambda ck: _edit_meta(ck, pp=1, shards=lambda s: [x for x in s if x["file"].endswith("pp000.safetensors")]),
        r"missing \['decoder.final_layernorm.weight'.*is meta.json's tp/pp/spec",
    ),
    "layer spec": (
        dict(),
        lambda ck: _edit_meta(ck, spec="te"),
        r"missing \['decoder.layers.0.mlp.linear_fc1.layer_norm_weight'",
    ),
    "pp does not divide layers": (
        dict(),
        lambda ck: _edit_meta(ck, pp=3),
        r"do not cover|pipeline split \(pp=3, pp_last_layers=0\) does not fit",
    ),
    "uneven split that does not fit": (
        dict(pp=2),
        lambda ck: _edit_meta(ck, pp_last_layers=2),
        r"pipeline split \(pp=2, pp_last_layers=2\) does not fit the model: .*split the remaining 0",
    ),
    "uneven split of another shape": (
        dict(pp=2),
        lambda ck: _edit_meta(ck, pp_last_layers=-1),
        r"pp_last_layers must be a non-negative integer",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_a_clear_error_and_no_output(tmp_path, case):
    layout, damage, message = BAD_INPUTS[case]
    ck = tmp_path / "ck"
    save_synthetic_checkpoint(ck, tiny_config("qwen2"), **layout)
    damage(ck)
    with pytest.raises(ConversionError, match=message):
        convert(ck, tmp_path / "out")
    assert leftovers(tmp_path, "out") == []


def test_dims_not_alignable_for_rollout_tp_are_refused(tmp_path):
    ck = tmp_path / "ck"
    save_synthetic_checkpoint(ck, tiny_config("llama", intermediate_size=384))
    with pytest.raises(ConversionError, match=r"(?s)rollout TP=2.*384 / 2 = 192.*TP sizes that work for it: \[1\]"):
        convert(ck, tmp_path / "out", rollout_tp=2)
    with pytest.raises(ConversionError, match=r"rollout TP=4.*TP=4 does not divide num_key_value_heads=2"):
        convert(ck, tmp_path / "out", rollout_tp=4)
    assert leftovers(tmp_path, "out") == []
    convert(ck, tmp_path / "out", rollout_tp=1)  # 384 = 3 blocks: fine unsplit
    convert(ck, tmp_path / "bf16", dtype="bf16", rollout_tp=2)  # BF16 has no blocks to straddle


def test_tokenizer_files_and_generation_config_are_copied(qwen2_tp2pp2, tmp_path):
    d, _ = qwen2_tp2pp2
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    (tok / "generation_config.json").write_text('{"temperature": 0.6}')
    (tok / "pytorch_model.bin").write_bytes(b"not copied")
    convert(d / "ckpt", tmp_path / "out", tokenizer_dir=tok)
    names = set(os.listdir(tmp_path / "out"))
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names and "pytorch_model.bin" not in names
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {"temperature": 0.6}
    with pytest.raises(ConversionError, match="holds none of the tokenizer files"):
        convert(d / "ckpt", tmp_path / "out2", tokenizer_dir=tmp_path / "out" / "..")


# -- verifier ----------------------------------------------------------------------------------------
def test_verify_passes_and_reports_per_layer_error(qwen2_tp2pp2):
    d, _ = qwen2_tp2pp2
    report = verify_checkpoint(d / "fp8", rollout_tps=(1, 2), reference=d / "bf16")
    assert report.ok, report.problems
    layers = report.layers()
    assert [r["layer"] for r in layers] == ["0", "1"]
    for row in layers:
        assert row["linears"] == 7 and 0.01 < row["rel_err_max"] < 0.04 and row["bound_ratio"] <= 1 and row["requant_equal"]
    assert verify_checkpoint(d / "bf16", reference=d / "bf16").ok


def test_verify_catches_misalignment_and_tampering(qwen2_tp2pp2, tmp_path):
    d, _ = qwen2_tp2pp2
    report = verify_checkpoint(d / "fp8", rollout_tps=(4,))
    assert not report.ok and any("k_proj.weight: output rows 256 / TP 4 = 64" in p for p in report.rollout_tp[4])
    # a scale grid that does not belong to its weight
    bad = tmp_path / "bad"
    convert(d / "ckpt", bad)
    tensors = load_dir(bad)
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name] * 1.5
    files = json.loads((bad / INDEX_NAME).read_text())["weight_map"]
    from megatron_jetrl.convert.hf_writer import write_safetensors

    for file in set(files.values()):
        write_safetensors(bad / file, [(k, tensors[k]) for k in tensors if files[k] == file])
    report = verify_checkpoint(bad, reference=d / "bf16")
    assert any(p.startswith("manifest: model-") for p in report.problems)
    (bad / MANIFEST_NAME).unlink()
    report = verify_checkpoint(bad, reference=d / "bf16")
    assert report.problems == [next(p for p in report.problems if "down_proj.weight: dequantized weight exceeds" in p)]


def test_clis_help_and_exit_codes(qwen2_tp2pp2, tmp_path):
    d, _ = qwen2_tp2pp2
    py = [sys.executable]
    for tool in ("convert_checkpoint.py", "verify_fp8_checkpoint.py"):
        out = subprocess.run(py + [str(REPO / "tools" / tool), "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "usage:" in out.stdout and "Example" in out.stdout
    conv = py + [str(REPO / "tools" / "convert_checkpoint.py")]
    out = subprocess.run(
        conv + [str(d / "ckpt"), str(tmp_path / "o"), "--quiet", "--rollout-tp", "4"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "error: FP8 export refused at rollout TP=4" in out.stderr and not (tmp_path / "o").exists()
    out = subprocess.run(
        conv + [str(d / "ckpt"), str(tmp_path / "o"), "--max-shard-size", "1MB"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "wrote" in out.stdout and "convert: 100%" in out.stderr
    ver = py + [str(REPO / "tools" / "verify_fp8_checkpoint.py"), str(tmp_path / "o")]
    out = subprocess.run(
        ver + ["--rollout-tp", "1", "2", "--reference", str(d / "bf16")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK") and "requant_equal" in out.stdout
    out = subprocess.run(ver + ["--rollout-tp", "4"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "FAILED" in out.stdout


def test_an_fp8_export_carries_the_runs_last_kv_cache_scales_where_the_trainer_decided_them(tmp_path):
    """The mapping table's KV scale entries feed the converter as they feed the sync: the scales of the run's
    trainer_state.json, as vLLM names them; none for a BF16 export or a run whose engine decides its scales."""
    flow = PrecisionFlow("jetrl", exact_logprobs=True, kv_cache="fp8")
    save_synthetic_checkpoint(tmp_path / "ckpt", tiny_config("qwen3"), tp=2, pp=2, flow=flow, seed=4)
    scales = torch.tensor([[0.01, 0.02, 0.03], [0.04, 0.05, 0.06]])
    state = {"step": 0, "kv_scales": {"scales": scales.tolist(), "running": scales.tolist(), "decided": True}}
    (tmp_path / "ckpt" / "trainer_state.json").write_text(json.dumps(state))
    convert(tmp_path / "ckpt", tmp_path / "fp8")
    out = load_dir(tmp_path / "fp8")
    for layer in range(2):
        for column, t in enumerate("qkv"):
            got = out[f"model.layers.{layer}.self_attn.attn.{t}_scale"]
            assert got.dtype == torch.float32 and got.tolist() == [scales[layer, column].item()]
    assert json.loads((tmp_path / "fp8" / MANIFEST_NAME).read_text())["kv_scales"] is True
    assert verify_checkpoint(tmp_path / "fp8").ok
    convert(tmp_path / "ckpt", tmp_path / "bf16", dtype="bf16")
    assert not any(n.endswith("_scale") for n in load_dir(tmp_path / "bf16"))
    state["kv_scales"]["scales"][1][2] = -1.0
    (tmp_path / "ckpt" / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ConversionError, match="finite positive scales"):
        convert(tmp_path / "ckpt", tmp_path / "bad")
    engine = PrecisionFlow("bf16-train-fp8-rollout", kv_cache="fp8", kv_scales="engine")
    save_synthetic_checkpoint(tmp_path / "engine", tiny_config("qwen3"), flow=engine, seed=4)
    (tmp_path / "engine" / "trainer_state.json").write_text(json.dumps(state))
    convert(tmp_path / "engine", tmp_path / "engine_fp8")
    assert not any(n.endswith("_scale") for n in load_dir(tmp_path / "engine_fp8"))
