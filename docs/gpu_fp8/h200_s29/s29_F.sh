# session 29 call F (issue 14): the CUDA tile quantizer's E4M3-input column pass (WGrad's re-quantized X) at 4 CTAs
# per SM (the tree) against 3 (a copy of the tree with the old launch bound): bench_fp8's quant section for each, in
# alternation; then the GPU tests of its bytes.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s29f; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1; grep -E "DeepGEMM|torch" $W/setup.log | head -3
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
rm -rf /tmp/alt && mkdir /tmp/alt && cp -r megatron_jetrl tools /tmp/alt/ && sed -i 's/#define QUANT_TILE_CTAS ((FP8_IN \&\& !ROWS) ? 4 : 3)/#define QUANT_TILE_CTAS 3/' /tmp/alt/megatron_jetrl/fp8/cuda_tiles.py && grep -c "QUANT_TILE_CTAS 3" /tmp/alt/megatron_jetrl/fp8/cuda_tiles.py
for r in 1 2; do
  el "ctas4 $r"; (PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD timeout 100 python3 -W ignore tools/bench_fp8.py --sections ceilings quant > $W/ctas4.$r.log 2>&1); grep -E "E4M3|dual 1x128|ceilings" $W/ctas4.$r.log | head -4
  el "ctas3 $r"; (cd /tmp/alt && PYTHONPATH=/tmp/dg:/tmp/mcore:/tmp/alt timeout 100 python3 -W ignore tools/bench_fp8.py --sections ceilings quant > $W/ctas3.$r.log 2>&1); grep -E "E4M3|dual 1x128|ceilings" $W/ctas3.$r.log | head -4
done
el tests; PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "tile or dual or requant or linear" -rf > $W/tests.log 2>&1; tail -2 $W/tests.log
el done
tar -czf $OUT/s29_F.tgz -C $W . 2>/dev/null
