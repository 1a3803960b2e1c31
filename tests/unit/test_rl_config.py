"""The GRPO config: YAML files compose (model preset, then precision mode), overrides win, and every preset
is valid -- FP8/TP alignment of the real architectures checked without their weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_jetrl.rl.config import ConfigError, load_config, split_args

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODELS = sorted((CONFIGS / "models").glob("*.yaml"))
MODES = sorted((CONFIGS / "modes").glob("*.yaml"))


def test_tiny_default():
    cfg = load_config()
    assert cfg.precision.mode == "jetrl" and cfg.parallel.world_size == 1 and cfg.arch().hidden_size == 256
    assert cfg.rollout.engine == "native"
    assert load_config(device="cpu").model.batch_invariant and not load_config(device="cuda").model.batch_invariant  # auto


@pytest.mark.parametrize("mode", MODES, ids=lambda p: p.stem)
@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.stem)
def test_every_preset_in_every_mode_is_valid(model, mode):
    cfg = load_config([model, mode])
    assert cfg.precision.mode == mode.stem and cfg.run.name == model.stem
    assert cfg.grpo.prompts_per_step * cfg.rollout.n == 256 and cfg.optim.lr == 1e-6 and cfg.loss.kl_coef == 1e-3
    arch = cfg.arch()  # the FP8 alignment at the preset's TP
    assert arch.num_kv_heads % cfg.parallel.tp == 0


def test_files_then_overrides_compose_in_order():
    files, overrides = split_args([str(MODELS[0]), str(MODES[0]), "parallel.tp=1", "rollout.tp=1", "run.name=x=y"])
    assert files == [str(MODELS[0]), str(MODES[0])] and overrides == ["parallel.tp=1", "rollout.tp=1", "run.name=x=y"]
    cfg = load_config(files, overrides)
    assert cfg.parallel.tp == 1 and cfg.run.name == "x=y" and cfg.precision.mode == MODES[0].stem


def test_one_entry_of_the_hf_config_is_overridden_and_the_others_kept():
    base = load_config(CONFIGS / "gpu_8b_shapes.yaml", ["run.device=cpu"]).model.hf_config
    cfg = load_config(CONFIGS / "gpu_8b_shapes.yaml", ["run.device=cpu", "model.hf_config.num_hidden_layers=28"])
    assert cfg.model.hf_config == {**base, "num_hidden_layers": 28}
    with pytest.raises(ConfigError, match=r"not of the form section.key=value .*model.hf_config.num_hidden_layers=28"):
        load_config(None, ["run.steps.x=1"])  # run.steps is no mapping


def test_misaligned_tp_is_refused_naming_the_layer_and_the_sizes_that_work():
    with pytest.raises(ConfigError, match=r"parallel.tp=8.*"):
        load_config([CONFIGS / "models/qwen2.5-7b.yaml", CONFIGS / "modes/jetrl.yaml"], ["parallel.tp=8"])


def test_preset_must_agree_with_the_checkpoint(tmp_path):
    cfg = load_config([CONFIGS / "models/qwen3-8b-base.yaml"], [f"model.path={tmp_path}"])
    disk = dict(cfg.model.hf_config, num_hidden_layers=48)
    (tmp_path / "config.json").write_text(json.dumps(disk))
    with pytest.raises(ConfigError, match=r"num_hidden_layers \(config 36, checkpoint 48\)"):
        cfg.model.check_path_matches()
    (tmp_path / "config.json").write_text(json.dumps(cfg.model.hf_config))
    cfg.model.check_path_matches()


def test_yaml_exponent_without_a_dot_is_a_number():
    assert load_config(None, ["optim.lr=5e-4"]).optim.lr == 5e-4


def test_a_rollout_split_other_than_the_trainers_is_noted_in_jetrl_only():
    """jetrl with vLLM engines split otherwise than the trainer (rollout.tp != parallel.tp) is valid but noted with
    its measured cost and the fix; the same split in bf16, or the matching one, is not."""
    base = ["rollout.engine=vllm", "parallel.tp=2"]
    cfg = load_config(CONFIGS / "gpu_8b_shapes.yaml", base + ["rollout.tp=1"])
    notes = cfg.notices()
    assert (
        len(notes) == 1
        and "rollout.tp=1 differs from parallel.tp=2" in notes[0]
        and notes[0].endswith("set rollout.tp=2 for the lowest mismatch")
    )
    assert load_config(CONFIGS / "gpu_8b_shapes.yaml", base + ["rollout.tp=2"]).notices() == []
    assert load_config(CONFIGS / "gpu_8b_shapes.yaml", base + ["rollout.tp=1", "precision.mode=bf16"]).notices() == []
    assert load_config().notices() == []


E2E_8B = [CONFIGS / "models/qwen3-8b-base.yaml", CONFIGS / "e2e_8b.yaml"]
PP1 = ["parallel.pp=1", "parallel.pp_last_layers=0"]  # e2e_8b's own layout is TP 1 x PP 4; these take TP alone
ND = "optim.distributed=false"  # (at parallel.dp=1 the preset's distributed optimizer has a note of its own)


def test_thin_fp8_shards_and_an_even_pipeline_split_are_noted_with_the_fix():
    """jetrl at TP 4 on Qwen3-8B (1024 hidden columns a rank) is noted with its measured cost and the layout that won;
    bf16 there, or TP 2, is not. An even pipeline split is noted with the last stage's count that evens the stages
    (`balanced_last_layers`); a given count, or PP 1, is not."""
    from megatron_jetrl.rl.config_schema import balanced_last_layers

    tp4 = load_config(E2E_8B, [*PP1, "parallel.tp=4", "rollout.tp=4", ND]).notices()
    assert (
        len(tp4) == 2 and tp4[0].startswith("parallel.tp=4 leaves each rank 1024 of hidden_size=4096") and "TP 1 x PP 4" in tp4[0]
    )
    assert tp4[1].startswith("precision.exact_logprobs resolved to false at parallel.tp=4") and "=true turns it on" in tp4[1]
    exact = load_config(E2E_8B, [*PP1, "parallel.tp=4", "rollout.tp=4", ND, "precision.exact_logprobs=true"])
    assert exact.precision.exact_logprobs and len(exact.notices()) == 1  # asked for: nothing to say
    assert load_config(E2E_8B, [*PP1, "parallel.tp=4", "rollout.tp=4", "precision.mode=bf16"]).notices() == []
    assert load_config(E2E_8B, [*PP1, "parallel.tp=2", "rollout.tp=2", ND]).notices() == []
    pp4 = load_config(E2E_8B, ["parallel.pp_last_layers=0", ND])  # an even split
    assert [n.split("; ")[-1] for n in pp4.notices()] == ["parallel.pp_last_layers=6 (what auto gives here) evens the stages"]
    # 36 layers, the output layer worth 151936 * 4096 * 1.1 / 193e6 = 3.5 layers: 10 + 10 + 10 + (6 + 3.5) against 9 + 9 + 9 + 12.5
    assert balanced_last_layers(pp4.arch(), 4) == 6 and balanced_last_layers(pp4.arch(), 2) == 16
    assert balanced_last_layers(pp4.arch(), 1) == 0
    assert load_config(E2E_8B, [ND]).notices() == []  # e2e_8b itself: 6 on the last stage
    tiny = load_config(None, ["parallel.pp=2"])  # 2 layers: no other split exists
    assert balanced_last_layers(tiny.arch(), 2) == 0 and tiny.notices() == []


def test_pp_last_layers_auto_resolves_to_the_balanced_split_and_is_recorded():
    """`parallel.pp_last_layers: auto` resolves to `balanced_last_layers` of the run's model, pipeline, precision and
    response length; the run records the count. At 18 Qwen3-8B layers in two stages at 1024 tokens the output layer
    is worth 3.5 BF16 layers and 4.8 FP8 ones: 11 + 7 in both modes (measured at PP 2 on two H200s: jetrl's step
    2632.6 ms at 10 + 8, 2518.2 ms at 11 + 7, BENCHMARKS.md)."""
    auto = ["parallel.pp_last_layers=auto", ND]
    pp4 = load_config(E2E_8B, auto)
    assert pp4.parallel.pp_last_layers == 6 and "parallel.pp_last_layers" in pp4.resolved_autos()
    assert pp4.to_dict()["parallel"]["pp_last_layers"] == 6
    assert load_config(E2E_8B, [*auto, "parallel.pp=2"]).parallel.pp_last_layers == 16
    half = [*auto, "parallel.pp=2", "model.hf_config.num_hidden_layers=18"]
    assert load_config(E2E_8B, half).parallel.pp_last_layers == 7
    assert load_config(E2E_8B, [*half, "precision.mode=bf16"]).parallel.pp_last_layers == 7
    assert load_config(E2E_8B, [*auto, "parallel.pp=1"]).parallel.pp_last_layers == 0
    with pytest.raises(ConfigError, match=r"parallel.pp_last_layers must be an integer or auto, got 'even'"):
        load_config(E2E_8B, ["parallel.pp_last_layers=even"])
    with pytest.raises(ConfigError, match=r"parallel.pp_last_layers must be >= 0 \(0: an even split\) or auto, got -1"):
        load_config(E2E_8B, ["parallel.pp_last_layers=-1"])


@settings(max_examples=200, deadline=None)
@given(
    layers=st.integers(2, 96),
    pp=st.integers(1, 16),
    hidden=st.sampled_from([512, 1024, 4096, 8192]),
    ffn=st.sampled_from([1024, 4096, 12288, 28672]),
    vocab=st.sampled_from([32000, 151936]),
    tokens=st.integers(0, 16384),
)
def test_the_balanced_split_is_one_megatron_takes_and_no_other_is_less_busy(layers, pp, hidden, ffn, vocab, tokens):
    """For any model, pipeline and length: the count is a split `stage_layers` takes (0: even), no split megatron takes
    has a less busy busiest stage, and FP8 layers (cheaper) never put more layers on the last stage than BF16 ones."""
    from megatron_jetrl.models.arch import ModelArch
    from megatron_jetrl.models.mapping import stage_layers
    from megatron_jetrl.rl.config_schema import FP8_LINEAR_SPEEDUP, HEAD_OVERHEAD, balanced_last_layers

    hf = dict(model_type="qwen3", hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
              num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 1024), head_dim=128, vocab_size=vocab)  # fmt: skip
    arch = ModelArch.from_hf_config(hf)
    got = {}
    for fp8 in (False, True):
        last = got[fp8] = balanced_last_layers(arch, pp, fp8, tokens)
        if pp == 1:
            assert last == 0
            continue
        layer = arch.linear_params / (FP8_LINEAR_SPEEDUP if fp8 else 1) + arch.num_heads * arch.head_dim * tokens
        head = vocab * hidden * HEAD_OVERHEAD / layer

        def busiest(n):
            split = stage_layers(layers, pp, n)
            return max(max(split[:-1]), split[-1] + head)

        valid = []
        for n in range(layers + 1):
            try:
                valid.append((busiest(n), n))
            except ValueError:
                pass
        if not valid:  # fewer layers than stages
            assert last == 0
            continue
        assert busiest(last) <= min(valid)[0] + 1e-9, (last, valid)
    if pp > 1 and got[True] and got[False]:
        assert got[True] <= got[False]


def test_the_presets_shard_the_optimizer_only_over_data_parallel_ranks():
    """`optim.distributed: auto` (the model presets): ZeRO-1 where parallel.dp > 1; at DP 1 megatron's mixed-precision
    optimizer, under which jetrl frees its linears' BF16 weights; an explicit value stays."""
    assert not load_config(E2E_8B).optim.distributed
    assert load_config(E2E_8B, [*PP1, "parallel.tp=2", "parallel.dp=2", "rollout.tp=2"]).optim.distributed
    assert load_config(E2E_8B, ["optim.distributed=true"]).optim.distributed
    assert not load_config(
        E2E_8B, [*PP1, "parallel.tp=2", "parallel.dp=2", "rollout.tp=2", "optim.distributed=false"]
    ).optim.distributed
    assert load_config(None, ["optim.distributed=auto", "parallel.dp=2"]).optim.distributed
    assert load_config(E2E_8B, ["precision.mode=jetrl"]).model.bf16_linear_weights == "release"  # auto, at DP 1
    with pytest.raises(ConfigError, match="optim.distributed"):
        load_config(E2E_8B, ["optim.distributed=sometimes"])


def test_the_distributed_optimizer_at_dp_1_is_noted_with_the_memory_it_keeps():
    """jetrl with optim.distributed=true at parallel.dp=1 keeps the FP8 linears' BF16 weights through each train step
    (its parameter buffers): noted with the GiB that optim.distributed=false frees (the largest stage's linears,
    2 bytes a parameter, on one TP rank); not at DP 2, nor in bf16, nor where the setting is given."""
    zero1 = "optim.distributed=true"
    pp4 = load_config(E2E_8B, [zero1]).notices()
    assert pp4 == [
        "optim.distributed=true at parallel.dp=1 shards nothing, and its parameter buffers keep the FP8 linears' "
        "BF16 weights through every train step; optim.distributed=false frees them (3.6 GiB a GPU here, "
        "model.bf16_linear_weights)"
    ]  # 10 layers x 193M linear parameters x 2 bytes
    assert any(
        "(3.2 GiB a GPU here" in n for n in load_config(E2E_8B, [*PP1, "parallel.tp=4", "rollout.tp=4", zero1]).notices()
    )  # 36 x 193M x 2 / 4
    for quiet in (
        [*PP1, "parallel.tp=2", "parallel.dp=2", "rollout.tp=2"],
        ["precision.mode=bf16"],
        ["model.bf16_linear_weights=keep"],
    ):
        assert not any(n.startswith("optim.distributed=true") for n in load_config(E2E_8B, [zero1, *quiet]).notices()), quiet


EIGHT_B = [CONFIGS / "models/qwen3-8b-base.yaml", CONFIGS / "modes/jetrl.yaml"]
TWO_NODES = ["parallel.tp=8", "parallel.dp=2", "rollout.engine=vllm", "rollout.tp=8"]  # 2 nodes x 8 GPUs


def test_qwen3_8b_on_two_nodes_of_eight_gpus_validates():
    """TP 8 x DP 2 = 16 ranks: 8 KV heads one per rank, every FP8 split dimension whole 128-blocks, the step's 64 x 4
    sequences in DP 2 x micro-batches of 4, two TP-8 vLLM engines of 8 consecutive ranks each."""
    cfg = load_config(EIGHT_B, TWO_NODES)
    assert (cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.world_size) == (8, 2, 16)
    assert (cfg.rollout.engine, cfg.rollout.tp, cfg.precision.mode) == ("vllm", 8, "jetrl")
    arch = cfg.arch()
    assert arch.num_kv_heads // cfg.parallel.tp == 1
    assert [(size // parts) % 128 for _, size, parts in arch.split_dims(8)] == [0] * 5
    notes = cfg.notices()  # rollout split = trainer split: nothing on the mismatch; 512 columns a rank: the TP cost;
    # exact logprobs left off by auto, and how to turn them on at TP 8 (both sides sum in rank order)
    assert len(notes) == 2 and notes[0].startswith("parallel.tp=8 leaves each rank 512 of hidden_size=4096")
    assert notes[1].startswith("precision.exact_logprobs resolved to false at parallel.tp=8")
    assert load_config(EIGHT_B, [*TWO_NODES, "precision.exact_logprobs=true"]).precision.exact_logprobs
    assert cfg.grpo.prompts_per_step * cfg.rollout.n % (cfg.parallel.dp * cfg.grpo.micro_batch_size) == 0
    from megatron_jetrl.rollout.colocated import rollout_groups

    assert rollout_groups(cfg.parallel.world_size, cfg.rollout.tp) == 2


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(EIGHT_B, [*TWO_NODES, *overrides])
    return str(e.value)


def test_wrong_two_node_layouts_are_refused_with_their_reason():
    # TP 16 splits 8 KV heads: the model's own check (ModelArch.check_fp8_tp), prefixed with the key
    arch = load_config(EIGHT_B, TWO_NODES).arch()
    with pytest.raises(ValueError) as model_says:
        arch.check_fp8_tp(16)
    assert _refusal("parallel.tp=16", "parallel.dp=1", "rollout.tp=16") == f"parallel.tp=16: {model_says.value}"
    assert "TP=16 does not divide num_key_value_heads=8" in str(model_says.value)
    # an intermediate size of 97 blocks: whole at TP 1, 12.125 blocks per shard at TP 8 (BF16 has no blocks: fine)
    odd = ["model.hf_config.intermediate_size=12416"]
    assert re.search(
        r"(?s)^parallel.tp=8: qwen3 model cannot run FP8 128x128 blocks at TP=8.*intermediate_size\): "
        r"12416 / 8 = 1552 is not a multiple of 128 \(TP sizes that work for it: \[1\]\)$",
        _refusal(*odd),
    )
    assert load_config(EIGHT_B, [*TWO_NODES, *odd, "precision.mode=bf16"]).arch().intermediate_size == 12416
    # the engines' own split must hold FP8 blocks too: a TP-16 engine over 8 KV heads, whatever the trainer's TP
    assert _refusal("rollout.tp=16") == f"rollout.tp=16: {model_says.value}"
    # rollout.tp must divide the 16 ranks
    assert _refusal("rollout.tp=3") == (
        "rollout.tp=3 must divide the number of ranks parallel.tp * pp * dp = 16 (each rank runs one TP rank of one vLLM engine)"
    )
    # 64 prompts x 4 samples = 256 sequences do not split over DP 2 x micro-batches of 3
    assert _refusal("grpo.micro_batch_size=3") == (
        "grpo.prompts_per_step * rollout.n = 256 sequences do not split into parallel.dp=2 x grpo.updates_per_step=1 x "
        "grpo.micro_batch_size=3: pick sizes whose product divides 256"
    )
    assert "do not split into parallel.dp=2" in _refusal("grpo.prompts_per_step=65")


def test_fp8_with_vllm_below_the_width_where_it_pays_is_noted_with_the_faster_engine():
    small = ["rollout.engine=vllm"]
    notes = load_config(CONFIGS / "learning_curves.yaml", []).notices()
    assert len(notes) == 1 and notes[0].startswith("hidden_size=768: at this width the FP8 GEMMs are too small")
    assert "below hidden_size 4096 a GRPO step with vLLM is usually slower in FP8 than in bf16" in notes[0]
    assert notes[0].endswith("(BENCHMARKS.md; rollout.engine=native: one engine on rank 0), which fits a one-rank run")
    assert load_config(CONFIGS / "learning_curves.yaml", ["precision.mode=bf16"]).notices() == []
    assert load_config(CONFIGS / "learning_curves.yaml", ["rollout.engine=native", "run.device=auto"]).notices() == []
    assert load_config(CONFIGS / "gpu_8b_shapes.yaml", small).notices() == []  # hidden 4096: FP8 pays
