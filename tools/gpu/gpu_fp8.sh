#!/usr/bin/env bash
# FP8 training speed on the GPU machine: kits, GPU tests and the FP8 benchmarks, from the repo root.
#
#   bash tools/gpu/gpu_fp8.sh STAGE...      STAGE: setup | tests | bench | jit-save     e.g. bash tools/gpu/gpu_fp8.sh setup tests bench
#
# carry (device tool), ~37 MiB with the repo (< 64 MiB):
#   [".kits/deep_gemm/deep_gemm.tar.xz", ".kits/te/bin", ".kits/te/v2.20.2/base", ".kits/te/v2.20.2/core-sm90", ".whl"]
#   deep_gemm 1.5 MiB, te/bin 0.03, te base 6.0 (prebuilt transformer_engine_torch wheel), te core-sm90 24.7,
#   .whl 2.9 (megatron-core 0.16.1 cp312 + math-verify wheels, as for gpu_vllm.sh), tracked repo ~1.8.
#   The kits come from shared/kits: `echo /.kits/ >> .git/info/exclude && cp -r ../shared/kits .kits`.
#
#   setup  DeepGEMM 2.5.0 (vLLM 0.26's bundle) -> /tmp/dg; Transformer Engine 2.20.2 (if .kits/te is here) ->
#          /tmp/te-site through .kits/te/bin/build.sh (prebuilt extension, sm90 core, ends with check.sh);
#          .whl/*.whl (megatron-core ...) -> /tmp/mcore. Skips what a machine set up earlier has.        ~1-2 min
#          Also loads carried DeepGEMM kernels (.cache/jit/deep_gemm_jit.tgz, tools/gpu/jit_cache.sh)
#   graphs the actor's layers as CUDA graphs (model.cuda_graphs=all) against eager, bf16 and jetrl (exact logprobs off:
#          SDPA attention, no vLLM kit): tools/bench/bench_actor.py, GRAPHS_LAYERS (8) Qwen3-8B layers,
#          GRAPHS_MICRO_BATCHES (32) micro-batches of 4 x 1088 tokens a step, at a TP 4 rank's width (tp4: 8/2 heads, ffn
#          3072, a quarter of the vocabulary; one GPU, no collectives) and at full width -> $OUT/graphs_{tp4,full}.{json,log};
#          GRAPHS_WIDTHS picks, GRAPHS_ARGS adds bench_actor.py args (--step-profile: kernel time by category)  ~4 min
#   jit-save  this machine's DeepGEMM kernels -> $OUT/deep_gemm_jit.tgz (tools/gpu/jit_cache.sh)
#   tests  tools/gpu/run_gpu_tests.sh -k "$TESTS_K" (default: kernels or fp8 or deepgemm or launch) ~1 min
#   bench  tools/bench/bench_fp8.py --sections ceilings quant linear layer profile -> $OUT/bench_fp8.{json,log};
#          tools/bench/bench_actor.py (whole actor step, jetrl vs bf16, exact logprobs off: no vLLM kit here)
#          -> $OUT/bench_actor.{json,log}                                                              ~3-5 min
#          DeepGEMM JIT-compiles each new GEMM shape (seconds each); every variant runs (and is checked)
#          once before it is timed, so compiles stay out of the timings.
# The whole run is meant to fit 10 minutes on an H200: each stage runs under `timeout`, and all of
# them together under TOTAL_TIMEOUT (default 560 s): a stage gets what is left. At the end: the tables and the
# target lines of both benchmarks (the part of the output that comes back).
# Env: OUT (default out/gpu_fp8), TOTAL_TIMEOUT, SETUP_TIMEOUT (240), TESTS_TIMEOUT (150), BENCH_FP8_TIMEOUT (300),
#      BENCH_ACTOR_TIMEOUT (240), GRAPHS_TIMEOUT (200 a width), TESTS_K, FP8_ARGS (extra bench_fp8.py args), ACTOR_ARGS (extra bench_actor.py args).
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
OUT=${OUT:-$repo/out/gpu_fp8}
mkdir -p "$OUT"
[ $# -gt 0 ] || { echo "usage: bash tools/gpu/gpu_fp8.sh STAGE... (setup | tests | bench | graphs | jit-save)"; exit 2; }
for stage in "$@"; do
  case $stage in setup|tests|bench|graphs|jit-save) ;; *) echo "unknown stage $stage (setup | tests | bench | graphs | jit-save)"; exit 2 ;; esac
done
T_END=$(( $(date +%s) + ${TOTAL_TIMEOUT:-560} ))

# seconds a step may take: its own limit, or what is left of the total (minus a few seconds for the recap)
budget() {
  local left=$(( T_END - $(date +%s) - 10 ))
  [ "$left" -lt 1 ] && left=1  # never 0: `timeout 0` would mean no limit
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

environment() {  # the paths setup fills; TE's env.sh only once TE is installed
  export PYTHONPATH=/tmp/dg:/tmp/mcore:$repo${PYTHONPATH:+:$PYTHONPATH}
  [ -d /tmp/te-site ] && [ -f .kits/te/bin/env.sh ] && source .kits/te/bin/env.sh
  export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}

setup() {
  local t
  bash tools/gpu/jit_cache.sh load
  if [ -f .kits/deep_gemm/deep_gemm.tar.xz ]; then
    if [ -f /tmp/dg/deep_gemm/__init__.py ]; then echo "DeepGEMM: already in /tmp/dg"
    else mkdir -p /tmp/dg && tar -xJf .kits/deep_gemm/deep_gemm.tar.xz -C /tmp/dg && echo "DeepGEMM: unpacked into /tmp/dg"; fi
  else
    echo "DeepGEMM: no kit (.kits/deep_gemm/deep_gemm.tar.xz not carried): backend auto falls back, the ceiling column says so"
  fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    if PYTHONPATH=/tmp/mcore python3 -c "import megatron.core" 2>/dev/null; then echo "megatron-core: already in /tmp/mcore"
    else python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl && echo "wheels: installed into /tmp/mcore: $(ls .whl)"; fi
  else
    echo "wheels: no .whl/ carried: bench_actor needs megatron-core"
  fi
  if [ -f .kits/te/bin/build.sh ]; then
    if [ -d /tmp/te-site ] && (source .kits/te/bin/env.sh && python3 -c "import transformer_engine.pytorch") >/dev/null 2>&1; then
      echo "TE: already in /tmp/te-site"
    else
      t=$(budget "${SETUP_TIMEOUT:-240}")
      WAIT=$(( t > 30 ? t - 30 : 10 )) timeout "$t" bash .kits/te/bin/build.sh 2.20.2 .kits/te/v2.20.2/base .kits/te/v2.20.2/core-sm90 \
        > "$OUT/te_setup.log" 2>&1
      echo "TE: build.sh exit $? (log $OUT/te_setup.log): $(tail -n 1 "$OUT/te_setup.log")"
    fi
  else
    echo "TE: no kit (.kits/te not carried): the TE columns say 'TE not installed'"
  fi
  environment
  python3 -W ignore - <<'PY'
import importlib, torch
print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}")
for mod in ("deep_gemm", "transformer_engine.pytorch", "megatron.core", "triton"):
    try:
        m = importlib.import_module(mod)
        print(f"  {mod}: {getattr(m, '__version__', 'ok')}")
    except Exception as e:  # noqa: BLE001
        print(f"  {mod}: NOT importable ({type(e).__name__}: {str(e)[:100]})")
PY
}

failed() {  # NAME EXIT LIMIT
  [ "$2" = 0 ] && return 0
  echo "$1: exit $2$([ "$2" = 124 ] && echo " (timed out after $3 s)")"; rc=1
}

show() {  # the log's progress lines on stdout, without warning noise
  grep --line-buffered -v -E "UserWarning|DeprecationWarning|warnings.warn|^\s*$"
}

recap() {
  echo "== recap (tables and targets; full logs and JSON in $OUT)"
  for f in "$OUT/bench_fp8.log" "$OUT/bench_actor.log"; do
    [ -f "$f" ] || continue
    echo "-- $(basename "$f")"
    grep -E "^\||^target|^ceiling|^profile:|^gap|^timeline|^  idle stretches|^  (GEMM|quantize|copy|elementwise|other|no kernel)|^extrapolated|memory probe|failed|FAILED|Error" "$f" \
      | grep -v "^| | " | tail -n 80
  done
}

environment
rc=0
for stage in "$@"; do
  t0=$(date +%s)
  echo "== stage $stage $(date -u +%TZ)"
  case $stage in
    setup) setup 2>&1 | tee "$OUT/setup.log"; environment ;;  # setup ran in a pipeline: pick up what it installed here
    tests)
      t=$(budget "${TESTS_TIMEOUT:-150}")
      [ "$t" -ge 30 ] || { echo "tests: skipped, only ${t} s left of TOTAL_TIMEOUT"; rc=1; continue; }
      timeout "$t" bash tools/gpu/run_gpu_tests.sh -k "${TESTS_K:-kernels or fp8 or deepgemm or launch}" 2>&1 | tee "$OUT/tests.log" | show | tail -n 40
      failed tests "${PIPESTATUS[0]}" "$t" ;;
    bench)
      t=$(budget "${BENCH_FP8_TIMEOUT:-300}")
      [ "$t" -ge 60 ] || { echo "bench: skipped, only ${t} s left of TOTAL_TIMEOUT"; rc=1; continue; }
      timeout "$t" python3 tools/bench/bench_fp8.py --sections ceilings quant linear layer profile --json "$OUT/bench_fp8.json" ${FP8_ARGS:-} 2>&1 \
        | tee "$OUT/bench_fp8.log" | show
      failed bench_fp8 "${PIPESTATUS[0]}" "$t"
      t=$(budget "${BENCH_ACTOR_TIMEOUT:-240}")
      if [ "$t" -lt 60 ]; then
        echo "bench_actor: skipped, only ${t} s left of TOTAL_TIMEOUT"; rc=1
      else
        timeout "$t" python3 tools/bench/bench_actor.py --json "$OUT/bench_actor.json" --override precision.exact_logprobs=false ${ACTOR_ARGS:-} 2>&1 | tee "$OUT/bench_actor.log" | show
        failed bench_actor "${PIPESTATUS[0]}" "$t"
      fi
      recap ;;
    graphs)
      for width in ${GRAPHS_WIDTHS:-tp4 full}; do
        t=$(budget "${GRAPHS_TIMEOUT:-200}")
        [ "$t" -ge 60 ] || { echo "graphs $width: skipped, only ${t} s left of TOTAL_TIMEOUT"; rc=1; continue; }
        extra=(); [ "$width" = tp4 ] && extra=(model.hf_config.num_attention_heads=8 model.hf_config.num_key_value_heads=2
                                               model.hf_config.intermediate_size=3072 model.hf_config.vocab_size=37984)
        timeout "$t" python3 tools/bench/bench_actor.py --layers "${GRAPHS_LAYERS:-8}" --seq 1088 --micro-batch 4 \
          --micro-batches "${GRAPHS_MICRO_BATCHES:-32}" --logprob-micro-batch 4 --warmup 1 --steps 2 \
          --override precision.exact_logprobs=false "${extra[@]}" ${GRAPHS_ARGS:-} \
          --modes bf16 jetrl bf16+model.cuda_graphs=all jetrl+model.cuda_graphs=all --json "$OUT/graphs_$width.json" 2>&1 \
          | tee "$OUT/graphs_$width.log" | grep -E "^\||Error"
        failed "graphs $width" "${PIPESTATUS[0]}" "$t"
      done ;;
    jit-save) bash tools/gpu/jit_cache.sh save "$OUT" || rc=1 ;;
  esac
  echo "== stage $stage done in $(( $(date +%s) - t0 )) s"
done
exit $rc
