#!/usr/bin/env bash
# vLLM on the GPU machine, after the kit is unpacked (shared/kits/README.md: two calls; .whl/ holds megatron-core
# and math-verify wheels, installed once into /tmp/mcore):
#
#   bash tools/gpu/gpu_vllm.sh STAGE...      STAGE: tests | bench | decode | report | grpo | native | diag | kv-rollout |
#                                            kv-actor | kv-scales | graphs | kv-mismatch | jit-save
#
#   tests   pytest tests/gpu/test_vllm.py (conformance, on-device sync bytes, refused update, sleep/wake cycle) and
#           tests/gpu/test_vllm_grpo.py (two GRPO steps of configs/gpu_1p5b.yaml with vLLM, ~2-3 min); TESTS=... picks
#           others, PYTEST_K=... selects (-k). JETRL_VLLM_TEST_ENGINE='{"enforce_eager": false}' runs test_vllm.py's engine
#           with full decode CUDA graphs (and the default glue, the trainer's)
#   bench   tools/bench/bench_vllm.py once per run of $RUNS (default "jetrl bf16": --mode jetrl, --mode bf16; start, sync,
#           decode at Qwen3-8B shapes) -> bench_MODE.json; a run MODE:VARIANT (e.g. RUNS="jetrl jetrl:vllm-glue jetrl:cutlass-gemm bf16:triton-attn",
#           bench_vllm.py --variant: what vLLM's fused quant kernels or another attention backend would buy) ->
#           bench_MODE_VARIANT.json. Split the runs over calls as the 10-minute limit needs; the same OUT collects them.
#           TP=4: one engine over 4 GPUs (rollout TP 4, torchrun; give it its own OUT: report compares runs of one TP)
#   decode  tools/bench/bench_rollout.py (the native engine, FP8 and BF16) at the setting of bench's JSON (36 layers, prompt 256,
#           512 new tokens, batches 64 128 256 unless BENCH_ARGS changed them: pass the same as NATIVE_ARGS), then
#           tools/bench/rollout_report.py: native and vLLM (every bench_*.json) in one table -> $OUT/rollout_report.md. Run after bench with the same
#           OUT (a machine that keeps /tmp between commands: OUT=/tmp/gpu_vllm).
#   report  tools/bench/rollout_report.py over $OUT/bench_*.json alone (no native run) -> $OUT/vllm_report.md: the decode
#           rates and, for batches both shipped runs profiled (BENCH_ARGS="--profile-batch 128 256"), the FP8 ceiling
#   grpo    tools/gpu/gpu_grpo_run.sh with rollout.engine=vllm, the three precision modes -> $OUT/vllm/
#   native  the same runs with the native engine (the FP8 floor: two programs, one flow) -> $OUT/native/
#   jit-save  this machine's DeepGEMM kernels -> $OUT/deep_gemm_jit.tgz (tools/gpu/jit_cache.sh: keep it as
#           .cache/jit/deep_gemm_jit.tgz and carry ".cache/jit": this script loads it first, so a fresh machine's FP8
#           engine starts warm)
#   diag    tools/gpu/diag_vllm_layers.py (8 layers, hidden 2048) with vLLM's own glue, then with the trainer's
#           (--glue trainer: rollout/vllm_glue.py) -> $OUT/diag_{vllm,trainer}.log; each run gets DIAG_TIMEOUT s
#           (default 220: a fresh machine's first engine spends ~90 s in DeepGEMM's JIT). Extra args: DIAG_ARGS
#   kv-rollout  the FP8 KV cache in the rollout: bench_vllm.py as one engine of the long-rollout runs (KV_LAYERS 36 layers,
#           KV_BATCH 32 sequences of 8 + KV_LEN 8192 tokens, KV_GB 40 GiB of cache, one timed run) in bf16, jetrl and jetrl
#           with an FP8 cache (KV_RUNS, MODE:CACHE[:PINS[:VARIANT]] each; PINS the attention's exact-logprob pins: empty or
#           absent as a run resolves them (jetrl: exact), exact, none, one-split or fp8-tile alone; VARIANT bench_vllm.py's
#           --variant, e.g. jetrl:fp8::aot-schedule) -> kv_rollout_*.json and a table:
#           tok/s, ratios, sequences held at once and the cache's room for them, the bandwidth ceiling (~3 min a run on an
#           H200; what the pins cost: KV_RUNS="bf16:bf16 jetrl:fp8 jetrl:fp8:none jetrl:fp8:one-split jetrl:fp8:fp8-tile").
#           KV_PROMPT (8) and KV_ARGS (to bench_vllm.py) too: KV_PROMPT=4096 KV_LEN=128 KV_ARGS="--profile-batch 32"
#           profiles a decode step at context ~4128, the 8192-token runs' mean
#   kv-actor  what FA3's FP8 attention costs the actor's update and logprob pass (bench_actor.py: KV_ACTOR_LAYERS 8 layers,
#           micro-batches of one KV_LEN-token sequence; bf16, jetrl, jetrl with an FP8 cache) -> kv_actor.{json,log}
#   kv-scales  bench_kv_scales.py (KV_SCALES_ARGS): each scale policy's logprobs against BF16 attention -> kv_scales.{json,log}
#   graphs  the actor's layers as CUDA graphs (model.cuda_graphs): bench_actor.py, GRAPHS_LAYERS (8) Qwen3-8B layers, 8
#           micro-batches of 4 x 1088 tokens, bf16 and jetrl each as shipped (no graphs) and with model.cuda_graphs=all, at
#           Qwen3-8B's width (full) and at a TP 4 rank's (tp4: 8/2 heads, ffn 3072, a quarter of the vocabulary; no
#           collectives) -> graphs_{tp4,full}.{json,log}; GRAPHS_WIDTHS picks, GRAPHS_TIMEOUT s each (250)
#   kv-mismatch  GRPO with vLLM (configs/gpu_8b_shapes.yaml at 2 layers, 320-token responses, 3 steps): jetrl and the foil,
#           each with a BF16 and an FP8 cache -> $OUT/kv_{bf16,fp8}/, their mismatch side by side
# Extra settings through the environment: BENCH_ARGS (to bench_vllm.py), RUNS (bench), GRPO_ARGS (overrides to every GRPO run).
# Carry: the kit's two calls carry one tarball each (61.1 and 61.5 MB) with .kits/vllm/{unpack.sh,SHA256SUMS}; with this
# tree (~5.6 MB tracked, most of it docs/) that is over a call's 64 MiB, so leave docs/ out of those two calls
# (`git rm -r -q --cached docs && echo /docs/ >> .git/info/exclude`, undone by `git reset -q -- docs` and removing the
# line). Later commands on that machine carry [".whl", ".kits/vllm/unpack.sh", ".kits/vllm/SHA256SUMS"] (+ ".cache/jit"):
# this script checks the unpack is complete, installs .whl/ into /tmp/mcore and loads the carried DeepGEMM kernels.
#   e.g.  OUT=$OUT RUNS="jetrl bf16" bash tools/gpu/gpu_vllm.sh tests bench jit-save
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
OUT=${OUT:-$repo/out/gpu_vllm}
mkdir -p "$OUT"
if [ -f .kits/vllm/unpack.sh ]; then  # carried (with SHA256SUMS): check the kit's two-call unpack is complete here
  bash .kits/vllm/unpack.sh --need-complete > "$OUT/unpack.log" 2>&1 \
    || { echo "the vLLM kit is incomplete on this machine (fresh machine? run the kit's two calls again): $(tail -n 2 "$OUT/unpack.log")"; exit 3; }
fi
[ -f /tmp/vllm-site/env.sh ] || { echo "the vLLM kit is not unpacked (/tmp/vllm-site/env.sh missing)"; exit 3; }
source /tmp/vllm-site/env.sh
if ! PYTHONPATH=/tmp/mcore${PYTHONPATH:+:$PYTHONPATH} python3 -c "import megatron.core, math_verify" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mcore .whl/*.whl || exit 3
fi
PYTEST_ARGS=(); [ -n "${PYTEST_K:-}" ] && PYTEST_ARGS=(-k "$PYTEST_K")
export PYTHONPATH=/tmp/mcore:$repo:$PYTHONPATH PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash tools/gpu/jit_cache.sh load

for stage in "$@"; do
  t0=$(date +%s)
  echo "== stage $stage $(date -u +%TZ)"
  case $stage in
    tests) python3 -m pytest -q -s -p no:cacheprovider -rf ${TESTS:-tests/gpu/test_vllm.py tests/gpu/test_vllm_grpo.py} "${PYTEST_ARGS[@]}" 2>&1 \
             | tee "$OUT/tests.log" | grep -E "passed|failed|error|^FAILED|^ERROR" ;;
    bench)
      for run in ${RUNS:-jetrl bf16}; do
        mode=${run%%:*}; variant=${run#*:}; [ "$variant" = "$run" ] && variant=shipped
        name=$mode; [ "$variant" = shipped ] || name=${mode}_$variant
        launcher=(python3); [ "${TP:-1}" -gt 1 ] && launcher=(python3 -m torch.distributed.run --standalone --nproc-per-node "$TP")
        "${launcher[@]}" tools/bench/bench_vllm.py --tp "${TP:-1}" --mode "$mode" --variant "$variant" --json "$OUT/bench_$name.json" \
          ${BENCH_ARGS:-} 2>&1 \
          | grep --line-buffered -v -E "UserWarning|warnings.warn" | tee "$OUT/bench_$name.log" | grep -E "^\[|Error|error" ;
      done ;;
    decode)
      python3 tools/bench/bench_rollout.py --layers 36 --prompt 256 --new-tokens 512 --batches 64 128 256 ${NATIVE_ARGS:-} \
        --json "$OUT/bench_rollout.json" 2>&1 | grep --line-buffered -v -E "UserWarning|warnings.warn" | tee "$OUT/bench_rollout.log" | tail -12
      python3 tools/bench/rollout_report.py --native "$OUT/bench_rollout.json" --vllm $(ls "$OUT"/bench_{jetrl,bf16}*.json) \
        -o "$OUT/rollout_report.md" ;;
    report) python3 tools/bench/rollout_report.py --vllm $(ls "$OUT"/bench_{jetrl,bf16}*.json) -o "$OUT/vllm_report.md" ;;
    grpo) OUT=$OUT/vllm RUN_TIMEOUT=${RUN_TIMEOUT:-240} bash tools/gpu/gpu_grpo_run.sh rollout.engine=vllm ${GRPO_ARGS:-} >/dev/null 2>&1
          tail -20 "$OUT/vllm/run.log"; cat "$OUT/vllm/table.md" ;;
    native) OUT=$OUT/native bash tools/gpu/gpu_grpo_run.sh ${GRPO_ARGS:-} >/dev/null 2>&1; cat "$OUT/native/table.md" ;;
    diag)
      for glue in vllm trainer; do
        timeout "${DIAG_TIMEOUT:-220}" python3 tools/gpu/diag_vllm_layers.py --layers 8 --show 2 --glue "$glue" ${DIAG_ARGS:-} \
          > "$OUT/diag_$glue.log" 2>&1
        echo "glue $glue: exit $?"; grep -E "^\||prompt logprobs|Error" "$OUT/diag_$glue.log" | grep -v INFO
      done ;;
    kv-rollout)
      for run in ${KV_RUNS:-bf16:bf16 jetrl:bf16 jetrl:fp8}; do
        IFS=: read -r mode cache pins variant <<<"$run"
        case ${pins:-auto} in  # the attention pins: as a run resolves them, all (exact), none, or one alone
          auto) attention=() ;; exact) attention=(--exact-logprobs true) ;; none) attention=(--exact-logprobs false) ;;
          *) attention=(--exact-logprobs false --pins "$pins") ;;
        esac
        [ -n "${variant:-}" ] && attention+=(--variant "$variant")
        timeout "${KV_TIMEOUT:-300}" python3 tools/bench/bench_vllm.py --mode "$mode" --kv-cache "$cache" "${attention[@]}" \
          --layers "${KV_LAYERS:-36}" --batches "${KV_BATCH:-32}" --prompt "${KV_PROMPT:-8}" --new "${KV_LEN:-8192}" --reps 0 \
          --sync-reps 1 --kv-gb "${KV_GB:-40}" ${KV_ARGS:-} --json "$OUT/kv_rollout_${run//:/_}.json" 2>&1 \
          | grep --line-buffered -v -E "UserWarning|warnings.warn" | tee "$OUT/kv_rollout_${run//:/_}.log" | grep -E "^\[|Error"
      done
      python3 tools/bench/rollout_report.py --kv "$OUT"/kv_rollout_*.json ;;
    kv-actor)
      python3 tools/bench/bench_actor.py --layers "${KV_ACTOR_LAYERS:-8}" --seq "${KV_LEN:-8192}" --micro-batch 1 \
        --micro-batches 4 --logprob-micro-batch 2 --warmup 1 --steps 2 --modes bf16 jetrl jetrl+precision.kv_cache=fp8 \
        --json "$OUT/kv_actor.json" 2>&1 | tee "$OUT/kv_actor.log" | grep -E "^\||FAILED|Error" ;;
    kv-scales) python3 tools/bench/bench_kv_scales.py --json "$OUT/kv_scales.json" ${KV_SCALES_ARGS:-} 2>&1 \
                 | tee "$OUT/kv_scales.log" | grep -E "^\||Error" ;;
    graphs)
      for width in ${GRAPHS_WIDTHS:-tp4 full}; do
        extra=(); [ "$width" = tp4 ] && extra=(--override model.hf_config.num_attention_heads=8 model.hf_config.num_key_value_heads=2
                                               model.hf_config.intermediate_size=3072 model.hf_config.vocab_size=37984)
        timeout "${GRAPHS_TIMEOUT:-250}" python3 tools/bench/bench_actor.py --layers "${GRAPHS_LAYERS:-8}" --seq 1088 --micro-batch 4 \
          --micro-batches 8 --logprob-micro-batch 4 --warmup 1 --steps 2 "${extra[@]}" \
          --modes bf16 bf16+model.cuda_graphs=all jetrl jetrl+model.cuda_graphs=all --json "$OUT/graphs_$width.json" 2>&1 \
          | tee "$OUT/graphs_$width.log" | grep -E "^\||Error"
      done ;;
    kv-mismatch)
      for kv in bf16 fp8; do
        OUT=$OUT/kv_$kv CONFIG=configs/gpu_8b_shapes.yaml MODES="jetrl bf16-train-fp8-rollout" SUFFIX=_kv$kv \
          RUN_TIMEOUT=${RUN_TIMEOUT:-150} bash tools/gpu/gpu_grpo_run.sh rollout.engine=vllm precision.kv_cache=$kv \
          model.hf_config.num_hidden_layers=2 rollout.max_new_tokens=320 run.steps=3 grpo.prompts_per_step=8 \
          grpo.micro_batch_size=32 ${GRPO_ARGS:-} >/dev/null 2>&1
        cat "$OUT/kv_$kv/table.md"
      done ;;
    jit-save) bash tools/gpu/jit_cache.sh save "$OUT" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "== stage $stage done in $(( $(date +%s) - t0 )) s"
done
