#!/usr/bin/env bash
# The GPU checks and measurements this tree still owes (docs/notes/gdn-prefill.md v21-v22,
# docs/notes/kda-prefill.md v11-v12, docs/notes/plain-prefill.md v1), in device calls of under ten
# minutes each:
#   bash benchmarks/gpu_checks.sh alltests  # every test below at once, side by side (first call; ~5 min?)
#   bash benchmarks/gpu_checks.sh tests     # GPU tests of what was built without a device
#   bash benchmarks/gpu_checks.sh coverage  # GPU tests owed from earlier sessions, bf16 A's casts
#   bash benchmarks/gpu_checks.sh plain-tests  # the plain rule's GPU tests alone (both kernel tiers)
#   bash benchmarks/gpu_checks.sh sweeps    # A_BF16 and the strided-input costs (~8 min)
#   bash benchmarks/gpu_checks.sh cold      # cold starts of the Gluon paths (first call, empty cache)
#   bash benchmarks/gpu_checks.sh plain     # the plain rule (GLA, Simple GLA, Lightning) on both kernel
#                                           # tiers: GPU tests, then the registry rows with the switch on (~8 min)
# Run from the repository root with .whl/ carried (../shared/device/peer-wheels.sh); results go to
# $OUT when set (the device tool's output folder).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
mkdir -p /tmp/tc && tar xzf .whl/fla-0.6.0-autotune-h200.tgz -C /tmp/tc
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
out=${OUT:-.}
t() { echo "== ${*:2}"; timeout "$1" python3 -m pytest -m gpu -q -p no:cacheprovider "${@:2}" 2>&1 | tail -4; }
# the test groups run side by side (correctness only; their compiles spread over the host's cores),
# each one's lines printed together once all are done
n=0
bg() { ( t "$@" > "/tmp/gpu_checks.$n" 2>&1 ) & n=$((n + 1)); }
show() { wait; for i in $(seq 0 $((n - 1))); do cat "/tmp/gpu_checks.$i"; done; }
tests() {
  bg 240 tests/ops/test_gluon_chunk_gdn.py -k "strided or host_only or segments or summaries"
  bg 240 tests/ops/test_gluon_chunk_kda.py -k "segment or a_in_bf16 or strided"
  bg 240 tests/ops/test_option_fuzz.py
  bg 180 tests/core/test_call_plan.py
  bg 120 tests/ops/test_compile.py
}
coverage() {
  # (the device-agnostic tests carry no gpu mark: -m "" keeps them, "not cpu" their CUDA cases)
  bg 240 tests/ops/test_triton_chunk_gdn.py tests/ops/test_triton_chunk_kda.py -m "" \
    -k "(launch_variants or sequence_parallel or strided or host_only or inverse_kernel or wide_blocks) and not cpu"
  bg 300 tests/ops/test_gluon_recurrent.py
}
plain_tests() {
  # PLAIN_RULE_ON_GPU is off until these pass; the tests switch it on themselves
  bg 300 tests/ops/test_triton_chunk_plain.py
  bg 120 tests/ops/test_recurrent.py -k lightning_decay_first_built_under_capture
}
case "${1:-tests}" in
  tests) tests; show ;;
  coverage) coverage; show ;;
  alltests) tests; coverage; plain_tests; show ;;       # every owed GPU test in one call
  plain-tests) plain_tests; show ;;
  sweeps)
    timeout 280 python3 benchmarks/kda_prefill_sweep.py --tier gluon --variants default,a-bf16 --out "$out" 2>&1 | tail -8
    timeout 280 python3 benchmarks/strided_inputs.py --out "$out" 2>&1 | tail -20
    ;;
  plain)
    plain_tests; show
    timeout 300 python3 -c "import sys; import fastla.backends.triton.chunk_delta as c; c.PLAIN_RULE_ON_GPU = True; \
from fastla.bench.runner import main; sys.exit(main(sys.argv[1:]))" --filter gla/,simple_gla/,lightning/ \
      --modes fwd --quick --no-cold --out "$out" 2>&1 | tail -12
    ;;
  cold)
    timeout 500 python3 -m fastla bench --filter gdn/h16-hv64/1x8192,gdn/h2-hv8/1x32768,kda/h64/1x8192 \
      --modes fwd --quick --cold-all --out "$out" 2>&1 | tail -12
    ;;
esac
