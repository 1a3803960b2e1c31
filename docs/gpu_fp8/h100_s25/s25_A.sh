# session 25 call A (H200, issue 14, no vLLM): the Triton quantizers' Markstein division (bytes, exhaustive division
# checks, speed beside the IEEE division), ncu of the SwiGLU quantizer, torch SDPA backends for the trainer's
# attention, then the four linears and the plain layer.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s25a; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( $1 - $(date +%s) + T0 )); }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1; grep -E "torch|deep_gemm|DeepGEMM|megatron" $W/setup.log | head -4
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
el tests; timeout $(left 230) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py \
  -k "division or quantize_1x128 or swiglu_fused_quantization or also_writes or cuda_tile_kernel_bytes_1x128 or non_finite or reference_quantizer" \
  -rf > $W/tests.log 2>&1; tail -1 $W/tests.log; grep -E "^FAILED|Error" $W/tests.log | head -8
el quant; timeout $(left 290) python3 -W ignore tools/bench_fp8.py --sections ceilings quant --json $W/quant_markstein.json > $W/quant_markstein.log 2>&1
grep -E "^\|" $W/quant_markstein.log | head -14
timeout $(left 330) python3 -W ignore .calls/s25_quant_ieee.py --sections quant --json $W/quant_ieee.json > $W/quant_ieee.log 2>&1
grep -E "^\|" $W/quant_ieee.log | head -14
el attn; timeout $(left 390) python3 .calls/s25_attn.py $W/attn.json > $W/attn.log 2>&1; cat $W/attn.log | cut -c1-160
el ncu; timeout $(left 450) ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section Occupancy -k regex:"quant" --launch-skip 2 --launch-count 6 python3 .calls/s25_ncu_quant.py > $W/ncu.txt 2>&1
grep -E "quant|Duration|Throughput|Issue Slots|Eligible|No Eligible|Issued Warp|Achieved Occ|Stall" $W/ncu.txt | head -30
el linear; timeout $(left 575) python3 -W ignore tools/bench_fp8.py --sections linear layer --json $W/linear.json > $W/linear.log 2>&1
grep -E "^\||target|decoder" $W/linear.log | head -30
el done
tar -czf $OUT/s25_A.tgz -C $W . 2>/dev/null
