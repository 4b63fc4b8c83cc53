#!/usr/bin/env bash
# One device call: engine benchmark on a synthetic 2B-4T-shaped model + oxbitnet on the same file
# + per-kernel timings (+ with SWEEP=1 the K1 variant sweep, tools/device/sweep_k1.py).
# Run through the device tool with carry [.gl, .whl]; results land in $OUT.
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/app PYTHONUNBUFFERED=1 BITNET_WEB_SYNTHETIC_DIR=/tmp BITNET_WEB_SYNTHETIC_ARCH=bitnet-25
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if [ "${TESTS:-0}" = 1 ]; then  # the K1 kernels against numpy on this GPU (subgroup size 32 paths)
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider -m "not slow" tests/test_kernels_linear.py 2>&1 | tail -5
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m bitnet_web bench --out "$OUT/engine.json" ${BENCH_ARGS:-} 2>&1 | tail -40
else  # still write the synthetic model (cached in /tmp) for the sweep's --model
  python3 -c "from bitnet_web.bench import synthetic_model; print(synthetic_model('2b4t'))"
fi
if [ "${SKIP_OX:-0}" != 1 ]; then timeout 300 python3 tools/device/oxbitnet_bench.py /tmp/synthetic-2b4t-bitnet-25.gguf "$OUT/oxbitnet.json" 2>&1 | tail -8; fi
if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  timeout 200 python3 tools/bench_kernels.py 2>&1 | tee "$OUT/kernels.txt" | tail -30
  timeout 100 python3 tools/bench_attention.py 2>&1 | tee "$OUT/attention.txt" | tail -15
fi
if [ "${SWEEP:-0}" = 1 ]; then
  timeout 300 python3 tools/device/sweep_k1.py --out "$OUT/sweep.json" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.txt" | tail -75
fi
