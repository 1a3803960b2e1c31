#!/usr/bin/env bash
# DeepGEMM's JIT-compiled kernels from one GPU machine to the next. A job may land on a fresh machine,
# whose first FP8 engine otherwise compiles for minutes (vLLM at Qwen3-8B shapes: 179-210 s to start cold, 44 s warm;
# BENCHMARKS.md). The kernels are plain files (cubins keyed by source and flags), valid on any sm_90 GPU with the same
# DeepGEMM and nvcc, so they can travel:
#
#   bash tools/gpu/jit_cache.sh save DIR   # this machine's caches -> DIR/deep_gemm_jit.tgz (e.g. DIR=$OUT: it comes back;
#                                          # keep it here as .cache/jit/deep_gemm_jit.tgz, which git ignores)
#   bash tools/gpu/jit_cache.sh load       # .cache/jit/deep_gemm_jit.tgz (carried: ".cache/jit") -> the caches; a no-op
#                                          # without it. tools/gpu/gpu_vllm.sh and tools/gpu/gpu_fp8.sh setup run it first
# (JIT_CACHE_TARBALL names another tarball to load.)
#
# The caches: vLLM's (DG_JIT_CACHE_DIR, which vLLM sets to $VLLM_CACHE_ROOT/deep_gemm, by default
# ~/.cache/vllm/deep_gemm) and the trainer's (DeepGEMM's default, ~/.deep_gemm), both stored relative to $HOME.
# The GPU machine returns files of at most 16 MiB: `save` says so and writes nothing larger.
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dirs=(.cache/vllm/deep_gemm .deep_gemm)
case ${1:-} in
  load)
    tarball=${JIT_CACHE_TARBALL:-$repo/.cache/jit/deep_gemm_jit.tgz}
    [ -f "$tarball" ] || exit 0
    mkdir -p "$HOME" && tar -xzf "$tarball" -C "$HOME" --skip-old-files && echo "jit_cache: loaded $(tar -tzf "$tarball" | grep -c '\.cubin$') DeepGEMM kernels into ~/{$(IFS=,; echo "${dirs[*]}")}" ;;
  save)
    [ -n "${2:-}" ] || { echo "usage: bash tools/gpu/jit_cache.sh save DIR"; exit 2; }
    mkdir -p "$2"
    present=(); for d in "${dirs[@]}"; do [ -d "$HOME/$d" ] && present+=("$d"); done
    [ ${#present[@]} -gt 0 ] || { echo "jit_cache: no DeepGEMM cache on this machine (~/{$(IFS=,; echo "${dirs[*]}")})"; exit 0; }
    tar -czf "$2/deep_gemm_jit.tgz" -C "$HOME" "${present[@]}"
    size=$(stat -c %s "$2/deep_gemm_jit.tgz")
    if [ "$size" -gt $(( 16 << 20 )) ]; then
      rm -f "$2/deep_gemm_jit.tgz"; echo "jit_cache: ${size} bytes is over the 16 MiB the GPU machine returns; not saved"; exit 1
    fi
    echo "jit_cache: $(tar -tzf "$2/deep_gemm_jit.tgz" | grep -c '\.cubin$') kernels, ${size} bytes -> $2/deep_gemm_jit.tgz" ;;
  *) echo "usage: bash tools/gpu/jit_cache.sh load | save DIR"; exit 2 ;;
esac
