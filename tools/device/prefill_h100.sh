#!/usr/bin/env bash
# One device call for prefill work: optionally `python -m bitnet_web bench` first (BENCH_FIRST=1: as
# tools/device/bench_h100.sh runs it, writing the synthetic 2B-4T model in-process), then
# tools/device/prefill_probe.py (kernel variants in isolation, then in the engine), with the GPU's SM
# clock sampled every 50 ms alongside ($OUT/clocks.csv; NVIDIA's clock idles at 345 MHz and climbs
# back over seconds, so timings must be read against it). Run through the device tool with carry
# [.gl, .whl]; results land in $OUT. Knobs: BENCH_FIRST=1, BENCH_LAST=1, PROBE=0, PROBE_ARGS, BENCH_ARGS,
# WARM_BENCH="128 512" (tools/device/bench_warm.py: clock up first, those prefill chunk sizes).
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/app PYTHONUNBUFFERED=1 BITNET_WEB_SYNTHETIC_DIR=/tmp BITNET_WEB_SYNTHETIC_ARCH=bitnet-25
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv,noheader
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 50 > "$OUT/clocks.csv" &
SMI=$!
bench() {
  echo "bench start $(date +%s.%N)" | tee -a "$OUT/marks.txt"
  python3 -m bitnet_web bench --out "$OUT/$1" ${BENCH_ARGS:-} > "$OUT/$1.log" 2>&1
  local rc=$?
  echo "bench end $(date +%s.%N) rc $rc" | tee -a "$OUT/marks.txt"
  python3 - "$OUT/$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k, v in r.items():
    if any(w in k for w in ("prefill", "decode_short_tok", "decode_1k_tok", "engine_greedy_decode", "load_s")):
        print(f"  {k}: {v:.1f}" if isinstance(v, float) else f"  {k}: {v}")
PY
}
if [ "${BENCH_FIRST:-0}" = 1 ]; then bench engine_first.json; fi
MODEL=$(python3 -c "from bitnet_web.bench import synthetic_model; print(synthetic_model('2b4t'))")
if [ "${PROBE:-1}" = 1 ]; then
  echo "probe start $(date +%s.%N)" >> "$OUT/marks.txt"
  timeout 420 python3 tools/device/prefill_probe.py "$MODEL" --out "$OUT" ${PROBE_ARGS:-} > "$OUT/probe.txt" 2>&1
  echo "probe rc $?"; sed -n '/==== summary/,$p' "$OUT/probe.txt"; grep -i "Traceback\|Error" "$OUT/probe.txt" | head -5
fi
if [ "${BENCH_LAST:-0}" = 1 ]; then bench engine.json; fi
for c in ${WARM_BENCH:-}; do  # bench with the clock brought up first and $c-row prefill chunks
  echo "warm bench chunk $c"
  python3 tools/device/bench_warm.py --chunk "$c" --warm 1.5 -- --model "$MODEL" --out "$OUT/engine_warm_$c.json" \
    > "$OUT/engine_warm_$c.log" 2>&1 || tail -5 "$OUT/engine_warm_$c.log"
  python3 - "$OUT/engine_warm_$c.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("  " + ", ".join(f"{k}: {r[k]:.1f}" for k in r if k.startswith(("prefill_", "decode_short_tok", "decode_1k_tok",
                                                                    "engine_greedy_decode", "engine_sampled_decode"))
                       and isinstance(r[k], float)))
PY
done
kill $SMI 2>/dev/null
python3 - "$OUT" <<'PY'
import datetime, sys
out = sys.argv[1]
marks = [line.split() for line in open(f"{out}/marks.txt")]
samples = []
for line in open(f"{out}/clocks.csv"):
    try:
        ts, clk, _ = [x.strip() for x in line.split(",")]
        t = datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc).timestamp()
        samples.append((t, int(clk.split()[0])))
    except ValueError:
        pass
t0 = samples[0][0]
print("SM clock (MHz) by second since the sampler started:",
      " ".join(f"{int(t - t0)}:{c}" for i, (t, c) in enumerate(samples) if i % 20 == 0))
print("marks:", " ".join(f"{m[0]} {m[1]} {float(m[2]) - t0:.1f}s" for m in marks))
PY
