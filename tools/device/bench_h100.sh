#!/usr/bin/env bash
# One device call: engine benchmark on a synthetic 2B-4T-shaped model + oxbitnet on the same file
# + per-kernel timings. Run through the device tool with carry [.gl, .whl]; results land in $OUT.
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/app PYTHONUNBUFFERED=1 BITNET_WEB_SYNTHETIC_DIR=/tmp BITNET_WEB_SYNTHETIC_ARCH=bitnet-25
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bitnet_web bench --out "$OUT/engine.json" ${BENCH_ARGS:-} 2>&1 | tail -40
if [ "${SKIP_OX:-0}" != 1 ]; then timeout 300 python3 tools/device/oxbitnet_bench.py /tmp/synthetic-2b4t-bitnet-25.gguf "$OUT/oxbitnet.json" 2>&1 | tail -8; fi
if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  timeout 200 python3 tools/bench_kernels.py 2>&1 | tee "$OUT/kernels.txt" | tail -30
  timeout 100 python3 tools/bench_attention.py 2>&1 | tee "$OUT/attention.txt" | tail -15
fi
