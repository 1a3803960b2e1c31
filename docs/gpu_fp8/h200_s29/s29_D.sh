# session 29 call D (issue 14): DeepGEMM with the WGMMA turns patch against unpatched, one process per variant,
# twice each in alternation (orig, wgrad, both, orig, wgrad, both); then the table.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s29d; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1; grep -E "DeepGEMM|torch" $W/setup.log | head -3
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD${PYTHONPATH:+:$PYTHONPATH}
(while true; do nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm --format=csv,noheader >> $W/clocks.csv; sleep 1; done) >/dev/null 2>&1 & CLK=$!
for r in 1 2; do for v in orig wgrad both; do
  el "$v $r"; timeout 150 python3 -W ignore docs/gpu_fp8/h200_s29/s29_turns.py $v $W/$v.$r.json > $W/$v.$r.log 2>&1; echo "rc $?"; tail -2 $W/$v.$r.log
done; done
python3 - $W <<'PY'
import json, sys, glob, statistics
W = sys.argv[1]
runs = {}
for f in sorted(glob.glob(f"{W}/*.json")):
    r = json.load(open(f)); runs.setdefault(r["variant"], []).append(r)
base = runs.get("orig", [])
if not base: sys.exit("no orig run")
names = list(base[0]["gemms"])
print("| GEMM | orig ms (TFLOP/s) | wgrad-patched | both-patched | bits equal |")
for n in names:
    cells, shas = [], set()
    for v in ("orig", "wgrad", "both"):
        rs = [r["gemms"][n] for r in runs.get(v, []) if n in r["gemms"]]
        shas |= {x["sha"] for x in rs}
        if rs:
            ms = statistics.mean(x["ms"] for x in rs); o = statistics.mean(x["ms"] for x in (r["gemms"][n] for r in base))
            cells.append(f"{ms:.3f} ({rs[0]['tflops']:.0f}{'' if v == 'orig' else f', x{o / ms:.2f}'})")
        else:
            cells.append("-")
    print(f"| {n} | " + " | ".join(cells) + f" | {len(shas) == 1} |")
odd = [r.get("odd") for v in runs.values() for r in v if r.get("odd")]
print("odd shapes bits equal across all runs:", all(o == odd[0] for o in odd), len(odd), "runs")
PY
el done; kill $CLK
tar -czf $OUT/s29_D.tgz -C $W . 2>/dev/null
