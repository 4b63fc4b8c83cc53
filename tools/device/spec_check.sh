#!/usr/bin/env bash
# One device call: speculative decoding on a real GPU, the checks first, then the costs.
#   1. tests/test_verify_rows.py (each verify row bit for bit its decode step, the GPU's own kernels)
#   2. `bench` on the bundled model: its speculation_policy rows say same_tokens_as_plain
#   3. tools/bench_kernels.py --verify-steps: a 2B-4T verify step over T rows / a decode step
# Run through the device tool with carry [.gl, .whl] (wgpu, cffi, pycparser, rendercanvas, sniffio,
# pytest, pluggy, iniconfig, packaging); results land in $OUT.
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/app PYTHONUNBUFFERED=1 XDG_RUNTIME_DIR=/tmp BITNET_WEB_SYNTHETIC_DIR=/tmp BITNET_WEB_SYNTHETIC_ARCH=bitnet-25
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_verify_rows.py 2>&1 | tee "$OUT/verify_rows.txt" | tail -6
timeout 150 python3 -m bitnet_web bench --model static/models/bitnet-pystdlib-27m-i2_s.gguf \
  --workload-model static/models/bitnet-pystdlib-27m-i2_s.gguf --out "$OUT/bundled.json" 2>&1 | tail -30
timeout 120 python3 tools/bench_kernels.py --verify-steps --paths fused,split 2>&1 | tee "$OUT/verify_steps.txt" | tail -20
