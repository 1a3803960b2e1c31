# session 24 call E4 (right after E3, same warm machine): the default engine's test_vllm.py (pool cycle with the KV
# sizing and the conditional empty_cache) and test_vllm_grpo.py (sync parts, memory released at sleep)
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s24; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash .kits/vllm/unpack.sh --need-complete > $W/unpack4.log 2>&1 || { echo "kit incomplete (machine released?)"; tail -3 $W/unpack4.log; exit 3; }
source /tmp/vllm-site/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/mcore:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
el tests; timeout 540 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_vllm.py tests/gpu/test_vllm_grpo.py -rf > $W/tests_default.log 2>&1
grep -E "passed|failed|Error|sync/|sleep" $W/tests_default.log | tail -8
el done
tar -czf $OUT/s24_E4.tgz -C $W tests_default.log 2>/dev/null; ls -la $OUT
