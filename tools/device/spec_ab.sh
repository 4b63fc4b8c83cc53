#!/usr/bin/env bash
# Two builds side by side on the device, alternating, for a speculative-decoding change (issue 15):
#
#   bash tools/device/spec_ab.sh OLD_SITE PART...
#
# OLD_SITE: a folder with the other build's app/, shaders/, tools/ and dist/ (dist/pyodide and
# dist/models may be missing: they are linked to this checkout's); this checkout (with dist/ carried)
# is the new build. WHL (default .whl) holds the wgpu-py, cffi, pycparser and rendercanvas wheels.
# Parts, in the order given, each run for OLD_SITE then this checkout, ROUNDS times (default 1):
#   verify    tools/bench_kernels.py --verify-steps: a whole synthetic 2B-4T step over T = 1..9 rows
#             (CONTEXT cached tokens, default 64) against T = 1
#   bundled   `python -m bitnet_web bench` on the bundled model with its speculative workloads
#   synth     `python -m bitnet_web bench` on the synthetic 2B-4T model (decode, prefill, Engine, policy)
#   pages     the bench page with the workloads (tools/device/browser_h100.sh PAGE_STEP, default workloads)
# Results in $OUT: one file per part, build and round.
set -u
OLD=${1:?OLD_SITE}; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/opt/device-browser/synth/synthetic-2b4t-bitnet-25.gguf
export BITNET_WEB_SYNTHETIC_DIR=/opt/device-browser/synth BITNET_WEB_SYNTHETIC_ARCH=bitnet-25
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
for d in pyodide models; do [ -e "$OLD/dist/$d" ] || ln -s "$PWD/dist/$d" "$OLD/dist/$d"; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${WHL:-.whl}"/*.whl || exit 1
mkdir -p "$(dirname $M)"
if [ ! -f $M ]; then
  say "writing the synthetic model"
  PYTHONPATH=/tmp/site:$PWD/app python3 -c "from bitnet_web.bench import synthetic_model; print(synthetic_model('2b4t'))"
fi
BUNDLED=$(ls dist/models/*.gguf | head -1)
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
for round in $(seq "${ROUNDS:-1}"); do
  for part in "$@"; do
    for site in "$OLD" .; do
      tag=$([ "$site" = . ] && echo new || echo old)_$round
      py() { PYTHONPATH=/tmp/site:$(cd "$site" && pwd)/app timeout "$1" python3 "${@:2}"; }
      say "$part $tag"
      case $part in
        verify) py 200 "$site/tools/bench_kernels.py" --verify-steps --context "${CONTEXT:-64}" --rounds 5 \
                  > "$OUT/verify_$tag.txt" 2>&1; tail -12 "$OUT/verify_$tag.txt" ;;
        bundled) py 200 -m bitnet_web bench --model "$BUNDLED" --workload-model "$BUNDLED" \
                  --out "$OUT/bundled_$tag.json" > "$OUT/bundled_$tag.out" 2>&1; tail -3 "$OUT/bundled_$tag.out" ;;
        synth) py 240 -m bitnet_web bench --model "$M" --workload-model '' \
                  --out "$OUT/synth_$tag.json" > "$OUT/synth_$tag.out" 2>&1; tail -3 "$OUT/synth_$tag.out" ;;
        pages) OUT=/tmp/pages_$tag bash tools/device/browser_h100.sh .device-browser "$site" "${PAGE_STEP:-workloads}" > "$OUT/pages_$tag.out" 2>&1
               tail -25 "$OUT/pages_$tag.out"; cp /tmp/pages_$tag/res.tgz "$OUT/pages_$tag.tgz" 2>/dev/null ;;
        *) say "unknown part $part" ;;
      esac
    done
  done
done
say done
