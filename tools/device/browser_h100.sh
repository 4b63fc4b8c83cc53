#!/usr/bin/env bash
# One device call of issue 13's measurements: this checkout's pages in headless Chromium on the GPU
# (staged by shared/device-browser's stage.sh in earlier calls of the same warm machine), with the
# browser's CPU time per process sampled from /proc and the GPU's utilization and clock from nvidia-smi.
#
#   bash tools/device/browser_h100.sh PACK SITE STEP...
#
# PACK: the folder holding the device-browser kit's bin/ (open_page.py); SITE: a folder with dist/
# (build.py build), app/, shaders/ and tools/, e.g. the checkout itself (`.` with dist carried); WHL (default
# SITE/whl) holds the wgpu-py, cffi, pycparser and rendercanvas wheels for the native rows, e.g. the carried
# .whl. Steps, in the order given:
#   overhead   static/bench/overhead.html (synthetic steps in plain JS, page + worker + Pyodide)
#   decode     static/bench/decode.html on the bundled model and the synthetic 2B-4T model
#   decodevar  decode.html on the synthetic 2B-4T model: 256-token runs at 16x2 (three times) and 16x3 (twice), then 4 timed runs
#   decodegaps decode.html on the synthetic model: 4 timed runs at 16x2 and 4 at 16x3 (GPU gaps, host submit/readback times)
#   decodeq2   the same at the default batching (16x2) only
#   smallbatch decode.html on the bundled model: 384-token runs at several batchings (at most 16 steps per submit)
#   bench      static/bench/?full=1 on both models (the page's own benchmark)
#   workloads  the bench page on the bundled model with speculative decoding's workloads (code, summary)
#   wonly      the workloads alone (QS=wruns=N&wks=2,4,7 for more runs of fewer draft sizes)
#   native     `python -m bitnet_web bench` (wgpu-py) on both models (nativebundled, benchbundled: the bundled model alone)
#   nbatch     tools/device/decode_batching.py (wgpu-py decode speed against the decode batching), both models
#   load       static/bench/load.html: the synthetic model stored in IndexedDB, then loaded from there
#              (3 loads at each read-ahead 4, 16, chunks stored as Blobs and as ArrayBuffers; per-phase times, the wasm heap)
#   loadblob   the same, 5 loads of Blob chunks at read-ahead 4, then the chunks read alone checked by their
#              SHA-256 (older builds' chunks), unchecked, and the records alone (read_only_s_by_variant)
#   loadfirst  3 loads of Blob chunks at read-ahead 4 (a fresh page's first load and two more; with COLD_SHADERS=1)
#   storage    static/bench/storage.html: IndexedDB read speed by value type, chunk size, read-ahead (no engine)
# The synthetic model is the one stage call 1 started writing into /opt/device-browser/synth.
# COLD_SHADERS=1 empties the GPU driver's shader caches before each page (see page()).
# Results: $OUT/summary.txt (tools/device/summarize.py, also printed) and $OUT/res.tgz (every page's JSON
# and log, the /proc samples, the CPU time per phase, the nvidia-smi trace).
set -u
PACK=${1:?PACK}; SITE=${2:?SITE}; shift 2
OUT=${OUT:-/tmp/out}; R=/tmp/res; rm -rf "$R"; mkdir -p "$R" "$OUT"
OP="python3 $PACK/bin/open_page.py --flags ${BROWSER_FLAGS:-gpu}"  # swiftshader: a local dry run
FL=(--extra-flag=--enable-webgpu-developer-features --extra-flag=--disable-dawn-features=timestamp_quantization)
M=/opt/device-browser/synth/synthetic-2b4t-bitnet-25.gguf
BUNDLED=$(ls "$SITE"/dist/models/*.gguf | head -1)
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
if printf '%s\n' "$@" | grep -qxE 'native|nativebundled|nbatch'; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${WHL:-$SITE/whl}"/*.whl || exit 1
fi
for i in $(seq 90); do [ -f $M ] && break; sleep 2; done
[ -f $M ] || { say "no synthetic model at $M"; cat /opt/device-browser/synth/log; }
ln -sf $M "$SITE/dist/synth.gguf"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm --format=csv,noheader -lms 200 > "$R/smi.csv" 2>&1 &
SMI=$!
python3 "$SITE/tools/device/proc_sample.py" "$R/procs.jsonl" &
PROCS=$!
page() {  # page NAME PATH [TIMEOUT]
  say "page $1: $2"
  # COLD_SHADERS=1: the GPU driver's own shader caches emptied too (a fresh profile empties Chromium's),
  # so a page's first load compiles every kernel as on a machine that never ran the app
  [ "${COLD_SHADERS:-0}" = 1 ] && rm -rf ~/.cache/nvidia ~/.nv ~/.cache/mesa_shader_cache
  $OP --serve "$SITE/dist" --path "$2${QS:+&$QS}" --wait window.benchResult "${FL[@]}" --timeout "${3:-240}" \
    --progress 'document.getElementById("status").textContent' --out "$R/$1.json" > "$R/$1.out" 2>&1
  say "page $1: exit $?"; tail -c 1500 "$R/$1.out" | grep -v '^\s*\[' | tail -3
}
for step in "$@"; do
  case $step in
    overhead) page overhead '/bench/overhead.html?' 200 ;;
    decode) page decode_bundled '/bench/decode.html' 150; page decode_synth '/bench/decode.html?model=../synth.gguf' 240 ;;
    decodevar) page decode_synth '/bench/decode.html?model=../synth.gguf&n=256&parts=batching,timestamps&batchings=1x2,16x2,16x2,16x2,16x3,16x3&tsruns=4' 300 ;;
    decodegaps|decodeq2)  # the timed runs alone, at the default batching (and at 16x3)
      page decode_synth '/bench/decode.html?model=../synth.gguf&n=256&parts=timestamps&tsruns=4' 200
      [ $step = decodeq2 ] || page decode_synth_q3 '/bench/decode.html?model=../synth.gguf&n=256&parts=timestamps&tsruns=4&tsbatching=16x3' 200 ;;
    smallbatch) page decode_bundled '/bench/decode.html?n=384&parts=batching&batchings=1x2,16x2,16x3,16x4,8x2,16x2' 200 ;;
    workloads) page workloads_bundled '/bench/?full=1&workloads=1' 240 ;;
    wonly) page workloads_bundled '/bench/?full=1&workloads=only' 240 ;;
    bench) page bench_bundled '/bench/?full=1' 150; page bench_synth '/bench/?full=1&model=../synth.gguf' 240 ;;
    benchbundled) page bench_bundled '/bench/?full=1' 150 ;;
    storage) page storage '/bench/storage.html?mb=600&chunks=16,64&ahead=4,16' 200 ;;
    load) page load_synth '/bench/load.html?model=../synth.gguf&runs=3&readahead=4,16&formats=blob,arraybuffer' 300 ;;
    loadfirst) page load_synth '/bench/load.html?model=../synth.gguf&runs=3&readahead=4&formats=blob' 200 ;;
    loadblob) page load_synth '/bench/load.html?model=../synth.gguf&runs=5&readahead=4&formats=blob&readonly=sha256,nocheck,getonly' 300 ;;
    native|nativebundled)
      models="synth bundled"; [ $step = nativebundled ] && models=bundled
      for m in $models; do
        f=$M; [ $m = bundled ] && f=$BUNDLED
        say "native $m"
        W=(); [ $m = bundled ] && W=(--workload-model "$f")
        BITNET_WEB_DEBUG=1 PYTHONPATH=/tmp/site:$(cd "$SITE" && pwd)/app timeout 200 python3 -m bitnet_web bench --model "$f" "${W[@]}" --out "$R/native_$m.json" > "$R/native_$m.out" 2>&1
        say "native $m: exit $?"
      done ;;
    nbatch)
      for m in synth bundled; do
        f=$M; [ $m = bundled ] && f=$BUNDLED
        say "native batching $m"
        PYTHONPATH=/tmp/site:$(cd "$SITE" && pwd)/app timeout 150 python3 "$SITE/tools/device/decode_batching.py" "$f" \
          "$R/nbatch_$m.list" 2>&1 | tee "$R/nbatch_$m.out" | tail -8
      done ;;
    *) say "unknown step $step" ;;
  esac
done
kill $SMI $PROCS 2>/dev/null
python3 "$SITE/tools/device/cpu_by_phase.py" "$R/procs.jsonl" "$R"/overhead.json "$R"/decode_*.json > "$R/cpu_by_phase.json" 2>"$R/cpu_by_phase.err"
python3 "$SITE/tools/device/summarize.py" "$R" | tee "$R/summary.txt"
tar czf "$OUT/res.tgz" -C "$R" .
cp "$R/summary.txt" "$OUT/"
say "done"
