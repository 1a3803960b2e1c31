#!/usr/bin/env bash
# Transformer Engine on the GPU machine: install the kit, run tests/gpu/test_te.py, compare the TE spec with
# the local spec in short GRPO runs, and (stages vllm, grpo) with vLLM as the rollout engine. One GPU (stage tp: two);
# .kits/te (shared/kits/te) and .whl/ (megatron-core, math-verify wheels) travel with the call:
#
#   bash tools/gpu/gpu_te.sh STAGE...      STAGE: install | tests | train | vllm | tp | grpo
#
#   install  the TE kit's one-call install (`fp8.te.INSTALL_LINE`: build.sh installs the prebuilt extension into
#            /tmp/te-site and ends with CHECK OK) and .whl/*.whl into /tmp/mcore; skipped when both are importable
#   tests    pytest -s tests/gpu/test_te.py -> $OUT/tests.log; its CONFORMANCE / TRAINSTEP / EXPORT lines -> $OUT/te_numbers.txt
#   train    tools/gpu/gpu_grpo_run.sh once per spec (local, te), modes $MODES, same seed -> $OUT/train_{local,te}/, then
#            tools/bench/te_compare.py -> $OUT/train_table.md (loss, mismatch vs the native rollout, step and phase times)
#   vllm     pytest -s tests/gpu/test_te_vllm.py (TE's FP8 bytes in vLLM: the converted checkpoint loaded with real
#            weights and the live sync, per scale mode in its own process; greedy generation) -> $OUT/vllm.log, its
#            TEVLLM lines -> $OUT/te_vllm_numbers.txt. Needs the vLLM kit unpacked first (shared/kits/README.md:
#            /tmp/vllm-site/env.sh is sourced when it exists) and TE installed (stage install)
#   tp       pytest -s tests/gpu/test_te_tp_gpu.py (2 GPUs: torchrun tests/gpu/te_tp_run.py, TE vs local spec at TP2 and the
#            TP2 TE export vs TE's full TP1 tensors) -> $OUT/tp.log, its TETP lines -> $OUT/te_tp_numbers.txt
#   grpo     tools/gpu/gpu_grpo_run.sh with model.spec=te rollout.engine=vllm rollout.enforce_eager=true run.steps=3 on
#            configs/gpu_1p5b.yaml, modes $MODES (default here "jetrl bf16-train-fp8-rollout") -> $OUT/grpo/
#            (needs the vLLM kit too)
#
# Environment: OUT (default out/gpu_te), MODES (default "jetrl bf16-train-fp8-rollout bf16"), SCALE (precision.scale_mode,
# default fp32), TRAIN_MODEL (small | 1p5b; default small: a Qwen-shaped 8-layer hidden-1024 model, 6 steps, so that
# six runs fit in ~4 minutes; 1p5b: configs/gpu_1p5b.yaml's Qwen2.5-1.5B shapes, 4 steps, ~10 minutes), RUN_TIMEOUT
# (per GRPO run, default 110 s small / 200 s 1p5b; grpo: 280 s, so two modes fit one 10-minute call), TRAIN_ARGS (extra overrides for every train and grpo run).
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
OUT=${OUT:-$repo/out/gpu_te}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

have_te() { [ -f /tmp/te-site/transformer_engine/__init__.py ] && (source .kits/te/bin/env.sh && python3 -c "import transformer_engine.pytorch" 2>/dev/null); }
env_te() {
  [ -f .kits/te/bin/env.sh ] || { echo "no .kits/te/bin/env.sh: carry .kits/te/bin (cp -r shared/kits .kits)"; exit 3; }
  source .kits/te/bin/env.sh
  if ! python3 -c "import megatron.core, math_verify" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mcore .whl/*.whl || exit 3
  fi
  export PYTHONPATH=/tmp/mcore:$repo:$PYTHONPATH
}

env_vllm() {  # after env_te: vLLM's site goes first on PYTHONPATH (both kits carry pydantic; vLLM's is the one it was checked with)
  if [ -f /tmp/vllm-site/env.sh ]; then source /tmp/vllm-site/env.sh
  else echo "no /tmp/vllm-site/env.sh: unpack the vLLM kit first (shared/kits/README.md); trying an installed vllm"; fi
}

gpu_pytest() {  # FILE LOG PATTERN NUMBERS: pytest -s FILE -> $OUT/LOG; the lines matching PATTERN -> $OUT/NUMBERS
  timeout 580 python3 -m pytest -q -s -p no:cacheprovider "$1" 2>&1 \
    | grep --line-buffered -v -E "UserWarning|warnings.warn\(|DeprecationWarning" | tee "$OUT/$2" \
    | grep -oE "$3|[0-9]+ (passed|failed|skipped).*|[A-Za-z]*Error.*"
  grep -oE "$3" "$OUT/$2" >"$OUT/$4"
}

for stage in "$@"; do
  t0=$(date +%s)
  echo "== stage $stage $(date -u +%TZ)"
  case $stage in
    install)
      if have_te; then echo "TE already installed in /tmp/te-site"; else
        timeout 560 bash .kits/te/bin/build.sh 2.20.2 .kits/te/v2.20.2/base .kits/te/v2.20.2/core-sm90 2>&1 | tail -25 | tee "$OUT/install.log"
        rc=${PIPESTATUS[0]}
        [ "$rc" = 0 ] || { echo "TE install failed (exit $rc; 3 = build still running: rerun install)"; exit 3; }
      fi
      env_te
      python3 -c "import transformer_engine.pytorch as t, megatron.core as m, torch; print('TE', t.__version__ if hasattr(t, '__version__') else '?', 'megatron-core', m.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1 | tee -a "$OUT/install.log" ;;
    tests)
      env_te
      gpu_pytest tests/gpu/test_te.py tests.log "(CONFORMANCE|TRAINSTEP|EXPORT) .*" te_numbers.txt ;;
    train)
      env_te
      if [ "${TRAIN_MODEL:-small}" = 1p5b ]; then
        model=(run.steps=4); timeout_s=${RUN_TIMEOUT:-200}
      else
        model=("model.hf_config={model_type: qwen2, hidden_size: 1024, intermediate_size: 2816, num_hidden_layers: 8, num_attention_heads: 8, num_key_value_heads: 2, head_dim: 128, vocab_size: 32768, max_position_embeddings: 1024, rope_theta: 1000000.0, rms_norm_eps: 1.0e-6, tie_word_embeddings: true, bos_token_id: 1, eos_token_id: 2}"
               run.steps=6); timeout_s=${RUN_TIMEOUT:-110}
      fi
      modes=${MODES:-jetrl bf16-train-fp8-rollout bf16}
      if [ "${SCALE:-fp32}" = ue8m0 ]; then  # PrecisionFlow refuses scale_mode=ue8m0 in mode bf16 (nothing is quantized)
        modes=$(echo " $modes " | sed 's/ bf16 / /g'); echo "SCALE=ue8m0: modes $modes (bf16 has no scale mode)"
      fi
      for spec in local te; do
        OUT=$OUT/train_$spec MODES="$modes" RUN_TIMEOUT=$timeout_s PYTHON=python3 \
          bash tools/gpu/gpu_grpo_run.sh "model.spec=$spec" "precision.scale_mode=${SCALE:-fp32}" "${model[@]}" ${TRAIN_ARGS:-} >/dev/null 2>&1
        echo "-- spec $spec:"; grep -E "^== .*exit|Error|error" "$OUT/train_$spec/run.log" | tail -8
      done
      python3 tools/bench/te_compare.py "$OUT/train_local" "$OUT/train_te" | tee "$OUT/train_table.md" ;;
    vllm)
      env_te; env_vllm
      gpu_pytest tests/gpu/test_te_vllm.py vllm.log "TEVLLM .*" te_vllm_numbers.txt ;;
    tp)
      env_te
      gpu_pytest tests/gpu/test_te_tp_gpu.py tp.log "TETP .*" te_tp_numbers.txt ;;
    grpo)
      env_te; env_vllm
      OUT=$OUT/grpo CONFIG=configs/gpu_1p5b.yaml MODES="${MODES:-jetrl bf16-train-fp8-rollout}" RUN_TIMEOUT=${RUN_TIMEOUT:-280} PYTHON=python3 \
        bash tools/gpu/gpu_grpo_run.sh model.spec=te rollout.engine=vllm rollout.enforce_eager=true run.steps=3 ${TRAIN_ARGS:-} >/dev/null 2>&1
      grep -E "^== .*exit|Error|error" "$OUT/grpo/run.log" | tail -12; cat "$OUT/grpo/table.md" ;;
    *) echo "unknown stage $stage (install | tests | train | vllm | tp | grpo)"; exit 2 ;;
  esac
  echo "== stage $stage done in $(( $(date +%s) - t0 )) s"
done
