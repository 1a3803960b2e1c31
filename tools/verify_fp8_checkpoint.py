#!/usr/bin/env python
"""Verify an HF checkpoint emitted by tools/convert_checkpoint.py before a rollout pool loads it.

Checks: config.json quantization_config; tensor names, dtypes and shapes against the model family's
mapping; index and manifest (sha256) consistency; FP8 block alignment at each --rollout-tp (vLLM's
validate_fp8_block_shape rule: every per-rank q/k/v, gate/up partition and row-parallel input % 128);
no NaN bytes, finite positive scales (powers of two for scale_fmt ue8m0).
With --reference BF16_DIR (e.g. from `convert_checkpoint.py --dtype bf16`): per-layer quantization error
(relative Frobenius, max abs, ratio to the E4M3 rounding bound, whether re-quantizing the reference gives
the same bytes) and BF16 tensors equal to the reference.
With --logits (needs transformers + accelerate): logits of the FP8 checkpoint (FineGrainedFP8, dequantized
on CPU) vs the BF16 reference on a few prompts.
Exit status: 0 all checks pass, 1 a check failed, 2 unreadable input.

Example:
  python tools/verify_fp8_checkpoint.py out/qwen3-fp8 --rollout-tp 1 2 4 --reference out/qwen3-bf16 --logits
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="HF checkpoint directory to verify")
    parser.add_argument(
        "--rollout-tp", type=int, nargs="+", default=[1], help="rollout TP size(s) to check alignment for (default 1)"
    )
    parser.add_argument("--reference", help="BF16 HF checkpoint of the same weights, for quantization error")
    parser.add_argument("--logits", action="store_true", help="compare FP8 vs --reference logits through transformers")
    parser.add_argument("--json", help="write the full report (every tensor) to this file")
    args = parser.parse_args(argv)
    if args.logits and not args.reference:
        parser.error("--logits needs --reference")

    from megatron_jetrl.convert.verify import compare_logits, verify_checkpoint

    try:
        report = verify_checkpoint(args.checkpoint, rollout_tps=args.rollout_tp, reference=args.reference)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.checkpoint}: {'FP8 block' if report.fp8 else 'BF16'} checkpoint")
    for p in report.problems:
        print(f"  FAIL {p}")
    for tp, problems in report.rollout_tp.items():
        print(f"  rollout TP={tp}: {'ok' if not problems else 'FAIL'}")
        for p in problems:
            print(f"    {p}")
    if report.tensors:
        print(
            f"  {'layer':>5} {'linears':>7} {'rel_err_max':>11} {'rel_err_rms':>11} {'max_abs_err':>11} {'bound_ratio':>11} requant_equal"
        )
        for row in report.layers():
            print(
                f"  {row['layer']:>5} {row['linears']:>7} {row['rel_err_max']:>11.4g} {row['rel_err_rms']:>11.4g} "
                f"{row['max_abs_err']:>11.4g} {row['bound_ratio']:>11.4g} {row['requant_equal']}"
            )
    ok = report.ok
    if args.logits and ok:
        try:
            report.logits = compare_logits(args.checkpoint, args.reference, report)
        except ImportError as e:
            print(f"  logits: skipped ({e}; pip install transformers accelerate)")
        else:
            lg = report.logits
            print(
                f"  logits on {lg['prompts'][0]} prompts x {lg['prompts'][1]} tokens: rel_l2 {lg['rel_l2']:.4g} "
                f"(bound {lg.get('bound', float('nan')):.4g}), max_abs {lg['max_abs_diff']:.4g}, top-1 agreement "
                f"{lg['top1_agreement']:.3f}, equal to BF16 model on bf16(q*s) weights: {lg['exact_vs_dequantized_bf16']}"
            )
            ok = ok and lg["exact_vs_dequantized_bf16"] and lg.get("within_bound", True)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
