# session 29 call E (issue 14): DeepGEMM's 1D1D WGrad with register / unrolling / scale-load edits (.calls/s29_wgvar.py)
# against unpatched, one process per variant, twice each in alternation; then the table.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s29e; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1; grep -E "DeepGEMM|torch" $W/setup.log | head -3
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD${PYTHONPATH:+:$PYTHONPATH}
for r in 1 2; do for v in orig regs nounroll lazyb; do
  el "$v $r"; timeout 100 python3 -W ignore docs/gpu_fp8/h200_s29/s29_wgvar.py $v $W/$v.$r.json > $W/$v.$r.log 2>&1; echo "rc $?"
done; done
python3 - $W <<'PY'
import json, sys, glob, statistics
W = sys.argv[1]
runs = {}
for f in sorted(glob.glob(f"{W}/*.json")):
    r = json.load(open(f)); runs.setdefault(r["variant"], []).append(r)
print("| WGrad | " + " | ".join(runs) + " | bits equal |")
for n in runs["orig"][0]["gemms"]:
    o = statistics.mean(r["gemms"][n]["ms"] for r in runs["orig"])
    cells, shas = [], set()
    for v, rs in runs.items():
        ms = statistics.mean(r["gemms"][n]["ms"] for r in rs); shas |= {r["gemms"][n]["sha"] for r in rs}
        cells.append(f"{ms:.3f} ({rs[0]['gemms'][n]['tflops']:.0f}, x{o / ms:.2f})")
    print(f"| {n} | " + " | ".join(cells) + f" | {len(shas) == 1} |")
PY
el done
tar -czf $OUT/s29_E.tgz -C $W . 2>/dev/null
