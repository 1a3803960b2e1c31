"""Bad configuration is refused at start-up, before any heavy work, with a message that names the key and the fix
(RELIABILITY.md, "bad configuration"). In-process against `megatron_jetrl.rl.config`, plus one launcher run that
shows the refusal comes before torchrun starts.

Cases marked xfail(strict=True) are defects found here and reported (RELIABILITY.md, "open defects"): each one
turns into a failure (XPASS) once fixed, so that the mark is removed and the row becomes a plain guard.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_jetrl.rl.config import ConfigError, config_from_dict, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
# The tiny model with heads of 4 x 128 and intermediate_size 384 = 3 blocks: aligned at TP1, not at TP2.
ODD_MLP = (
    "model.hf_config={model_type: qwen2, hidden_size: 256, intermediate_size: 384, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 4, head_dim: 128, vocab_size: 256}"
)


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides))
    return str(e.value)


# ---- unknown keys -------------------------------------------------------------------------------------------

CASES = {
    # name: (overrides, regex the message must match: the key and the fix)
    "unknown key, close match": (["run.stpes=3"], r"unknown key run\.'stpes' \(did you mean 'steps'\?\)"),
    "unknown section": (["trainer.lr=1"], r"unknown key 'trainer' \(known: data, grpo, loss, model, optim, parallel, precision"),
    "unknown key, no match": (["optim.zzz=1"], r"unknown key optim\.'zzz' \(known: .*adam_beta1.*lr"),
    "override without =": (
        ["parallel.tp"],
        r"override 'parallel.tp' is not of the form section.key=value \(e.g. parallel.tp=2\)",
    ),
    "override with three parts": (["run.a.b=1"], r"not of the form section.key=value"),
    # ---- wrong types
    "int given a word": (["run.steps=three"], r"run.steps must be an integer, got 'three'"),
    "int given a float": (["run.steps=1.5"], r"run.steps must be an integer, got 1.5"),
    "int given a bool": (["parallel.tp=true"], r"parallel.tp must be an integer, got True"),
    "bool given a word": (["run.export=maybe"], r"run.export must be true or false, got 'maybe'"),
    "float given a word": (["optim.lr=fast"], r"optim.lr must be a number, got 'fast'"),
    "str given a list": (["run.name=[a]"], r"run.name must be a string, got \['a'\] \(quote it in YAML\)"),
    "mapping given a number": (["model.hf_config=5"], r"model.hf_config must be a mapping, got 5"),
    "choice": (["run.on_nonfinite=ignore"], r"run.on_nonfinite must be 'stop' or 'skip', got 'ignore'"),
    "choice (resume)": (["run.resume=maybe"], r"run.resume must be 'auto' or 'never'"),
    "negative timeout": (["run.timeout_s=0"], r"run.timeout_s must be positive, got 0"),
    "no checkpoint but an export": (
        ["run.checkpoint=false"],
        r"run.checkpoint=false writes no checkpoint, but run.export=true .*set run.export=false",
    ),
    # ---- precision / scale settings that do not fit together
    "ue8m0 scales in bf16 mode": (
        ["precision.mode=bf16", "precision.scale_mode=ue8m0"],
        r"scale_mode='ue8m0' has no effect in mode='bf16' .*pick an FP8 mode or leave scale_mode='fp32'",
    ),
    "unknown mode": (["precision.mode=fp4"], r"precision: invalid PrecisionFlow: mode must be one of"),
    "unknown scale mode": (["precision.scale_mode=e8m0"], r"scale_mode must be one of \('fp32', 'ue8m0'\)"),
    "zero eps": (["precision.eps=0"], r"eps must be a small positive float \(vLLM uses 1e-10\), got 0.0"),
    "unknown backend": (["precision.backend=cuda"], r"backend must be one of \('auto', 'emulated'"),
    # ---- 128-block alignment at the requested TP
    "FP8 block straddles a TP shard": (
        [ODD_MLP, "parallel.tp=2"],
        r"(?s)parallel.tp=2: qwen2 model cannot run FP8 128x128 blocks at TP=2.*"
        r"intermediate_size\): 384 / 2 = 192 is not a multiple of 128 \(TP sizes that work for it: \[1\]\)",
    ),
    "TP does not divide the KV heads": (["parallel.tp=4"], r"parallel.tp=4: TP=4 does not divide num_key_value_heads=2"),
    "pipeline stages that do not divide the layers": (
        ["parallel.pp=3"],
        r"parallel.pp=3 does not divide the model's 2 layers \(each pipeline stage holds as many\): use a pp among \[1, 2\]",
    ),
    "a last stage of every layer": (
        ["parallel.pp=2", "parallel.pp_last_layers=2"],
        r"parallel.pp_last_layers=2: the other 1 stage\(s\) must split the remaining 0 of num_hidden_layers=2 "
        r"evenly, at least one layer each",
    ),
    "a last stage without stages": (
        ["parallel.pp_last_layers=1"],
        r"parallel.pp_last_layers=1 needs pipeline stages: set parallel.pp > 1",
    ),
    "a negative last stage": (["parallel.pp=2", "parallel.pp_last_layers=-1"], r"parallel.pp_last_layers must be >= 0"),
    # ---- batch sizes that do not divide
    "micro-batch does not divide": (
        ["grpo.micro_batch_size=7"],
        r"prompts_per_step \* rollout.n = 64 sequences do not split into parallel.dp=1 x "
        r"grpo.updates_per_step=1 x grpo.micro_batch_size=7: pick sizes whose product divides 64",
    ),
    "dp does not divide": (["parallel.dp=3"], r"parallel.dp=3 .* pick sizes whose product divides 64"),
    "updates per step do not divide": (["grpo.updates_per_step=3"], r"grpo.updates_per_step=3 .* divides 64"),
    "warm-up batch vs dp": (
        ["parallel.dp=2", "warmup.batch_size=33"],
        r"warmup.batch_size=33 must be a multiple of parallel.dp=2",
    ),
    "group of one": (["rollout.n=1"], r"GRPO needs at least 2 samples per prompt"),
    # ---- data / model sources
    "dataset without a path": (["data.source=gsm8k"], r"data.source='gsm8k' needs data.path"),
    "trace task scored by its leading number": (
        ["data.source=multiplication_trace"],
        r"data.source=multiplication_trace .* set data.reward_style=final \(got 'number'",
    ),
    "trace task given a path": (
        ["data.source=multiplication_trace", "data.reward_style=final", "data.path=x.jsonl"],
        r"multiplication_trace is generated in-process: drop data.path \('x.jsonl'\)",
    ),
    "multiplier range upside down": (
        ["data.multiplier_min=5", "data.multiplier_max=4"],
        r"data.multiplier_min=5 and data.multiplier_max=4 must satisfy 1 <= multiplier_min <= multiplier_max",
    ),
    "unknown multiplier sampling": (
        ["data.multiplier_sampling=linear"],
        r"data.multiplier_sampling must be 'uniform' or 'log', got 'linear'",
    ),
    "negative steps": (["run.steps=-1"], r"run.steps must be >= 0 \(0: the warm-start alone\), got -1"),
    "negative held-out": (["data.heldout=-4"], r"data.heldout must be >= 0 \(0: no held-out problems\), got -4"),
    "negative eval interval": (["run.eval_every=-1"], r"run.eval_every must be >= 0 \(0: no held-out evaluation\), got -1"),
    "evaluation without held-out problems": (
        ["run.eval_every=10"],
        r"run.eval_every=10 scores the policy on held-out problems, but data.heldout=0 "
        r"holds none out: set data.heldout \(e.g. 128\) or run.eval_every=0",
    ),
    "unknown advantage scale": (["grpo.advantage_scale=mad"], r"grpo.advantage_scale must be 'std' or 'none', got 'mad'"),
    "negative logprob micro-batch": (
        ["grpo.logprob_micro_batch_size=-8"],
        r"grpo.logprob_micro_batch_size must be >= 0 \(0: grpo.micro_batch_size\), got -8",
    ),
    "logprob micro-batch that does not split the batch": (
        ["grpo.logprob_micro_batch_size=48"],  # 16 prompts x 4 = 64 sequences on one rank
        r"grpo.logprob_micro_batch_size=48 does not divide the 64 sequences each data-parallel rank scores .*pick a divisor of 64",
    ),
    "logprob micro-batch over the data-parallel share": (
        ["grpo.logprob_micro_batch_size=64", "parallel.dp=2", "grpo.micro_batch_size=8"],
        r"grpo.logprob_micro_batch_size=64 does not divide the 32 sequences each data-parallel rank scores",
    ),
    "unknown weight-transpose policy": (
        ["model.fp8_weight_t=never"],
        r"model.fp8_weight_t must be 'step' or 'backward', got 'never'",
    ),
    "hf tokenizer without a path": (["model.tokenizer=hf"], r"model.tokenizer='hf' needs model.path"),
    "architecture field missing": (["model.hf_config={model_type: qwen2}"], r"model.hf_config lacks 'num_attention_heads'"),
    # ---- what an engine refuses of the model's positions (the tiny model has 64)
    "responses as long as the model": (
        ["rollout.max_new_tokens=64"],
        r"rollout.max_new_tokens=64 leaves no position for a prompt in the model's "
        r"max_position_embeddings=64 .*vLLM refuses such a request.*set rollout.max_new_tokens below 64",
    ),
    "responses longer than the model, no warm-start": (
        ["rollout.max_new_tokens=200", "warmup.steps=0"],
        r"rollout.max_new_tokens=200 leaves no position for a prompt",
    ),
    "a vLLM engine longer than the model": (
        ["model.hf_config.max_position_embeddings=1024", "rollout.max_model_len=2048"],
        r"rollout.max_model_len=2048 is longer than the model's max_position_embeddings=1024 "
        r"\(vLLM refuses an engine longer than the model\): set rollout.max_model_len to at most 1024",
    ),
    "no positions": (
        ["model.hf_config.max_position_embeddings=0"],
        r"sizes must be positive integers: max_position_embeddings=0",
    ),
    "RoPE base of zero": (["model.hf_config.rope_theta=0"], r"rope_theta must be a finite number > 0 .*got rope_theta=0.0"),
    "RMSNorm without a floor": (["model.hf_config.rms_norm_eps=0"], r"rms_norm_eps in \(0, 1\), .*rms_norm_eps=0.0"),
    "unsupported family": (
        ["model.hf_config={model_type: mistral, num_attention_heads: 2}"],
        r"model_type='mistral'; megatron-jetrl supports",
    ),
    # ---- sequence parallelism's overlap of communication and GEMMs
    "SP overlap off the list": (
        ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.sp_overlap=async"],
        r"parallel.sp_overlap must be none, chunks or ring, got 'async'",
    ),
    "SP overlap without sequence parallelism": (
        ["parallel.tp=2", "parallel.sp_overlap=ring"],
        r"parallel.sp_overlap=ring overlaps sequence parallelism's forward communication: set "
        r"parallel.sequence_parallel=true, or parallel.sp_overlap=none",
    ),
    "one piece": (
        ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.sp_overlap=chunks", "parallel.sp_chunks=1"],
        r"parallel.sp_chunks=1 pieces: give 2 or more",
    ),
    "pieces without chunks": (
        ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.sp_chunks=2"],
        r"parallel.sp_chunks=2 is the piece count of parallel.sp_overlap=chunks \(here none\): set "
        r"parallel.sp_overlap=chunks, or leave sp_chunks at 4",
    ),
    "pieces round the ring": (
        ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.sp_overlap=ring", "parallel.sp_chunks=8"],
        r"parallel.sp_chunks=8 is the piece count of parallel.sp_overlap=chunks \(here ring\)",
    ),
    "SP overlap in BF16": (
        ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.sp_overlap=ring", "precision.mode=bf16"],
        r"parallel.sp_overlap=ring overlaps the local spec's FP8 gathers and reduce-scatters; precision.mode=bf16 with "
        r"model.spec=local runs megatron's BF16 ones: set parallel.sp_overlap=none",
    ),
    # ---- the actor's CUDA graphs (actor.layer_graphs)
    "CUDA graphs: a word off the list": (
        ["model.cuda_graphs=update"],
        r"model.cuda_graphs must be 'none', 'logprobs' or 'all', got 'update'",
    ),
    "CUDA graphs on the CPU": (
        ["run.device=cpu", "model.cuda_graphs=logprobs"],
        r"model.cuda_graphs=logprobs: CUDA graphs need a GPU run, not run.device=cpu: set it to none",
    ),
    "CUDA graphs of the batch-invariant path": (
        ["run.device=cuda", "model.cuda_graphs=logprobs", "model.batch_invariant=true", "precision.mode=bf16"],
        r"model.cuda_graphs=logprobs: the batch-invariant reference path \(model.batch_invariant=true\) runs eagerly",
    ),
    "CUDA graphs with a sync per quantization": (
        ["run.device=cuda", "model.cuda_graphs=all", "precision.check_finite=sync"],
        r"model.cuda_graphs=all: precision.check_finite=sync reads every quantization's scales on the host, which a graph "
        r"cannot: set it to none",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_setting_is_refused_naming_key_and_fix(case):
    overrides, message = CASES[case]
    assert __import__("re").search(message, refused(*overrides)), refused(*overrides)


def test_cuda_graphs_of_te_layers_are_refused(monkeypatch):
    monkeypatch.setattr("megatron_jetrl.fp8.te.te_installed", lambda: True)
    message = refused("run.device=cuda", "model.spec=te", "model.cuda_graphs=all", "precision.mode=bf16")
    assert "model.cuda_graphs=all: it graphs the local spec's layers, not model.spec=te's: set it to none" in message


def test_the_same_settings_fit_where_they_should():
    """The refusals above are about the combination, not the values: each passes where it fits."""
    load_config(None, [ODD_MLP, "parallel.tp=1"])  # 384 = 3 whole blocks unsplit
    load_config(None, [ODD_MLP, "parallel.tp=2", "precision.mode=bf16"])  # BF16 has no blocks to straddle
    load_config(None, ["precision.mode=jetrl", "precision.scale_mode=ue8m0"])
    load_config(None, ["grpo.micro_batch_size=8", "parallel.dp=2", "warmup.batch_size=32"])
    load_config(None, ["run.steps=0", "run.eval_every=5", "data.heldout=16"])
    assert load_config(None, ["grpo.logprob_micro_batch_size=64"]).grpo.logprob_batch == 64
    assert load_config(None, ["grpo.micro_batch_size=8"]).grpo.logprob_batch == 8  # 0: the training micro-batch
    graphs = ["run.device=cuda", "model.hf_config.num_hidden_layers=4"]
    assert load_config(None, [*graphs, "model.cuda_graphs=all"]).model.cuda_graphs == "all"
    assert load_config(None, [*graphs, "model.cuda_graphs=logprobs", "parallel.pp=2"]).model.cuda_graphs == "logprobs"
    assert load_config(None, [*graphs, "model.cuda_graphs=all", "parallel.pp=2"]).model.cuda_graphs == "all"
    assert (
        load_config(None, [*graphs, "parallel.tp=2", "precision.mode=bf16", "model.cuda_graphs=all"]).model.cuda_graphs == "all"
    )
    assert load_config(None, ["run.device=cuda"]).model.cuda_graphs == "none"  # the default
    sp = ["parallel.tp=2", "parallel.sequence_parallel=true", "precision.exact_logprobs=false"]
    assert load_config(None, [*sp, "parallel.sp_overlap=chunks", "parallel.sp_chunks=3"]).parallel.sp_chunks == 3
    assert load_config(None, [*sp, "parallel.sp_overlap=ring"]).parallel.sp_overlap == "ring"


def test_a_heldout_set_the_task_cannot_fill_is_a_config_error():
    """data.heldout is checked against the task's distinct questions when the problems are built (session)."""
    from megatron_jetrl.rl.session import problem_sets

    cfg = load_config(
        None,
        [
            "data.source=multiplication_trace",
            "data.reward_style=final",
            "data.operand_max=3",
            "data.multiplier_max=4",
            "data.heldout=13",
        ],
    )
    with pytest.raises(ConfigError, match=r"13 distinct problems asked, but the task has 12 distinct questions"):
        problem_sets(cfg)
    train, held = problem_sets(load_config(None, ["data.heldout=40"]))
    assert len(held) == 40 and len(train) == 4096 and not {p.question for p in held} & {p.question for p in train}


class WordTokenizer:
    """One token a word: prompt lengths a test can count."""

    def encode(self, text):
        return text.split()


def test_a_prompt_without_room_for_the_responses_is_refused_when_the_data_is_built():
    """Where the limit needs the data (a prompt's length), the session checks every prompt, GRPO's and the held-out
    ones, once, before anything is built: the longest named, with the fix."""
    from megatron_jetrl.grpo.data import Problem, format_prompt
    from megatron_jetrl.rl.session import check_prompt_room

    def problems(*words, prefix="p"):
        return [Problem(f"{prefix}/{i}", " ".join(["w"] * n), "1", "arithmetic") for i, n in enumerate(words)]

    cfg = load_config(None, ["rollout.max_new_tokens=40"])
    arch, tok = cfg.arch(), WordTokenizer()
    template = len(tok.encode(format_prompt(Problem("x", "", "1", "arithmetic"), cfg.data.template)))
    room = 64 - 40 - template  # the tiny model's 64 positions, less the responses and the template's own words
    check_prompt_room(cfg, arch, tok, problems(1, room), problems(room))  # fits exactly
    with pytest.raises(
        ConfigError,
        match=r"1 of the 3 prompts leave no room for rollout.max_new_tokens=40 within the model's "
        r"max_position_embeddings=64: the longest, held-out problem h/1, is 25 tokens; "
        r"lower rollout.max_new_tokens to 39 or leave the longest prompts out of the data",
    ):
        check_prompt_room(cfg, arch, tok, problems(1), problems(room, room + 1, prefix="h"))
    with pytest.raises(ConfigError, match=r"2 of the 3 prompts .*the longest, problem p/2, is 27 tokens"):
        check_prompt_room(cfg, arch, tok, problems(1, room + 1, room + 3), [])
    check_prompt_room(cfg, arch, tok, [], [])


def test_a_warm_start_example_longer_than_the_model_is_refused_before_any_step():
    from types import SimpleNamespace

    from megatron_jetrl.rl.sft import sft_warm_start

    class Wordy:  # every text is 40 tokens: question + answer + EOS = 81 > the tiny model's 64 positions
        eos_id = 2

        def encode(self, text):
            return [5] * 40

    cfg = load_config(None, ["warmup.steps=2"])
    s = SimpleNamespace(cfg=cfg, arch=cfg.arch(), tokenizer=Wordy(), heldout=[])
    with pytest.raises(
        ConfigError,
        match=r"the warm-start's longest example is 81 tokens, more than the model's "
        r"max_position_embeddings=64: raise model.hf_config's max_position_embeddings",
    ):
        sft_warm_start(s)


def test_config_file_problems(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML"):
        load_config(str(bad))
    listed = tmp_path / "list.yaml"
    listed.write_text("- run\n- model\n")
    with pytest.raises(ConfigError, match=r"mapping"):
        load_config(str(listed))
    typo = tmp_path / "typo.yaml"
    typo.write_text(TINY.read_text().replace("save_every:", "save_evry:"))
    with pytest.raises(ConfigError, match=r"unknown key run\.'save_evry' \(did you mean 'save_every'\?\)"):
        load_config(str(typo))
    with pytest.raises(ConfigError, match=r"section run must be a mapping"):
        config_from_dict({"run": 5})


def test_launcher_refuses_before_torchrun_starts(tmp_path):
    """The launcher asks the config module for the world size first: a bad config exits 2 in about a second,
    with the message and the fix, and nothing is created."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "JETRL_TRAIN_MODULE")}
    env["PYTHON"] = sys.executable
    start = time.monotonic()
    r = subprocess.run(
        ["bash", str(REPO / "launch" / "train_grpo.sh"), str(TINY), f"run.out_dir={tmp_path / 'run'}", "grpo.micro_batch_size=7"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    took = time.monotonic() - start
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()  # the config's own message and nothing else: no launcher advice around it
    assert len(lines) == 1 and lines[0].startswith(
        "config error: grpo.prompts_per_step * rollout.n = 64 sequences do not split"
    ), r.stderr
    assert "torch.distributed.run" not in r.stderr and "process(es)" not in r.stderr  # torchrun never started
    assert not (tmp_path / "run").exists()
    assert took < 30, f"the refusal took {took:.1f} s"


# ---- defects: accepted at start-up today, fail later or train on garbage ------------------------------------

ACCEPTED_BUT_BAD = {
    "optim.lr=nan": ["optim.lr=.nan"],
    "optim.lr=inf": ["optim.lr=.inf"],
    "optim.lr<0": ["optim.lr=-1"],
    "optim.adam_beta1>=1": ["optim.adam_beta1=1.5"],
    "optim.clip_grad<0": ["optim.clip_grad=-1"],
    "run.timeout_s=inf (OverflowError in init_process_group)": ["run.timeout_s=.inf"],
    "rollout.temperature=inf": ["rollout.temperature=.inf"],
    "run.name='..' (writes into the parent of runs/)": ["run.name=.."],
    "run.seed=2**64 (overflows the torch seed)": ["run.seed=18446744073709551616"],
}


@pytest.mark.parametrize("case", sorted(ACCEPTED_BUT_BAD))
def test_values_that_cannot_train_are_refused(case):
    refused(*ACCEPTED_BUT_BAD[case])


def test_zero_kv_heads_is_a_config_error():
    refused(
        "model.hf_config={model_type: qwen2, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, "
        "num_attention_heads: 2, num_key_value_heads: 0, head_dim: 128, vocab_size: 256}"
    )


def test_batch_invariant_needs_the_emulated_backend_at_load_time():
    refused("model.batch_invariant=true", "precision.backend=triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_device_without_cuda_is_refused_before_torchrun(capsys):
    """The launchers' question (`--get parallel.world_size`, asked on the machine that runs the ranks) refuses it;
    checking a config alone does not (the presets say run.device=cuda and are checked on any machine)."""
    from megatron_jetrl.rl import config

    assert config.main(["run.device=cuda", "--get", "parallel.world_size"]) == 2
    assert capsys.readouterr().err.startswith(
        "config error: run.device='cuda' but no CUDA device is visible on this machine: "
        "run on a GPU node (check CUDA_VISIBLE_DEVICES and the driver) or set run.device=cpu"
    )
    assert config.main(["run.device=cuda"]) == 0 and load_config(None, ["run.device=cuda"]).run.device == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_config_error_after_the_process_group_exists_is_a_clean_exit_2(tmp_path, monkeypatch, capsys):
    """The trainer (ranks started without the launcher's question): the device is checked once the process group
    exists, in build_session; that ConfigError, like any other, is one `config error:` line and exit 2."""
    from megatron_jetrl.rl import faults, session, train

    monkeypatch.setattr(session, "init_distributed", lambda cfg: None)
    monkeypatch.setattr(faults, "watch", lambda cfg: None)
    assert train.main([f"run.out_dir={tmp_path}", "run.device=cuda"]) == 2
    assert capsys.readouterr().err.startswith("config error: run.device='cuda' but no CUDA device is visible")


ENTRY_POINTS = {  # name: (command before the config arguments, extra environment)
    "launcher": (["bash", "launch/train_grpo.sh"], {}),
    "trainer": ([sys.executable, "-m", "megatron_jetrl.rl.train"], {}),
    "config question": ([sys.executable, "-m", "megatron_jetrl.rl.config", "--get", "parallel.world_size"], {}),
    "compare_modes.sh": (["bash", "launch/compare_modes.sh", "--modes", "bf16 jetrl", "--out", "{out}"], {}),
    "tp_sweep.sh": (["bash", "launch/tp_sweep.sh", "--tp", "1 2", "--out", "{out}", "--"], {}),
    "sbatch": (["bash", "launch/slurm/train_grpo.sbatch"], {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "JETRL_DRY_RUN": "1"}),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_gives_a_config_error_as_the_configs_message_alone(tmp_path, entry):
    """A misspelt key from each way of starting a run: exit 2, the config's one line and nothing else, nothing written."""
    command, extra = ENTRY_POINTS[entry]
    out = tmp_path / "out"
    command = [c.format(out=out) for c in command]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_", "JETRL_"))}
    env.update(PYTHON=sys.executable, SLURM_SUBMIT_DIR=str(REPO), **extra)
    start = time.monotonic()
    r = subprocess.run(
        [*command, str(TINY), f"run.out_dir={out}", "grpo.micro_batch_sise=4"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().splitlines() == [
        "config error: unknown key grpo.'micro_batch_sise' (did you mean 'micro_batch_size'?)"
    ], r.stderr
    assert not out.exists() and time.monotonic() - start < 60
