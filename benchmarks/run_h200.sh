#!/usr/bin/env bash
# One call on the H200: install FLA 0.6.0 from .whl/ (see ../shared/device/peer-wheels.sh), print the
# stack, run the demo and the GPU tests, then the benchmark with FLA side by side.
#   bash benchmarks/run_h200.sh [arguments for python -m fastla bench]
# Results go to $OUT when set (the device tool's output folder), else benchmarks/results.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/tc && tar xzf .whl/fla-0.6.0-autotune-h200.tgz -C /tmp/tc
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
results=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -m fastla check
python3 -m fastla demo
python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -15
python3 -m fastla bench --out "$results" "$@"
