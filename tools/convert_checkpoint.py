#!/usr/bin/env python
"""Convert a megatron-jetrl actor checkpoint (Megatron TP x PP shards) into an HF directory a vLLM rollout loads.

Default output is the FP8 block format: every linear (q/k/v/o, gate/up/down) as float8_e4m3fn `weight`
+ float32 `weight_scale_inv` [ceil(N/128), ceil(K/128)], embeddings, lm_head, norms and biases in BF16,
and config.json with quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128]} (+ scale_fmt: ue8m0 for power-of-two scales). The FP8 bytes are the
trainer's: each TP shard is quantized with the trainer's forward quantizer (the same (hf_name, tensor)
stream as the live weight sync), so the output does not depend on the trainer's TP or PP.

The output is built in <output>.partial-<pid> and renamed into place when complete; every file carries
a sha256 in jetrl_manifest.json. Exit status: 0 done, 2 bad input or arguments, or the output cannot be written
(one line; nothing written).

Example:
  python tools/convert_checkpoint.py runs/ckpt/iter_0000100 out/qwen3-fp8 --tokenizer-dir /models/Qwen3-8B --rollout-tp 2
  python tools/convert_checkpoint.py runs/ckpt/iter_0000100 out/qwen3-bf16 --dtype bf16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="actor checkpoint directory (meta.json + tpXX_ppYYY.safetensors)")
    parser.add_argument("output", help="HF output directory (must not exist unless --force)")
    parser.add_argument(
        "--dtype",
        choices=("fp8", "bf16"),
        default="fp8",
        help="fp8: block-quantized rollout checkpoint (default); bf16: plain BF16 checkpoint",
    )
    parser.add_argument(
        "--rollout-tp",
        type=int,
        default=1,
        help="refuse unless every per-rank q/k/v, gate/up partition and row-parallel input is a "
        "multiple of 128 at this rollout TP (vLLM's rule; default 1)",
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="size cap of each safetensors shard, e.g. 5GB, 500MiB (default 5GB)"
    )
    parser.add_argument("--tokenizer-dir", help="copy tokenizer files and generation_config.json from this HF directory")
    parser.add_argument("--force", action="store_true", help="replace an existing output (only after the new one is complete)")
    parser.add_argument(
        "--skip-sha256", action="store_true", help="do not re-hash the input shards against meta.json (sizes are still checked)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from megatron_jetrl.convert import ConversionError, OutputExistsError, convert

    try:
        result = convert(
            args.checkpoint,
            args.output,
            dtype=args.dtype,
            rollout_tp=args.rollout_tp,
            max_shard_size=args.max_shard_size,
            force=args.force,
            tokenizer_dir=args.tokenizer_dir,
            progress=not args.quiet,
            verify_sha256=not args.skip_sha256,
        )
    except (ConversionError, OutputExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: converting {args.checkpoint} to {args.output}: {e}", file=sys.stderr)
        return 2
    shards = [f for f in result.files if f.endswith(".safetensors")]
    print(
        f"wrote {result.output}: {result.num_tensors} tensors, {result.total_size / 2**20:.1f} MiB in {len(shards)} shard(s), "
        f"{result.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
