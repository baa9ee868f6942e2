#!/usr/bin/env bash
# GPU checks and measurements in device calls of under ten minutes each:
#   bash benchmarks/gpu_checks.sh tests        # every chunked-forward GPU test, in groups side by side
#                                              # (~7 min; each group stopped after LIMIT s; ONLY picks
#                                              # some: gluon-gdn gluon-kda plain fuzz triton plans
#                                              # large (batches past 2^31 elements: <= 50 GB);
#                                              # exit 1 if a group failed)
#   bash benchmarks/gpu_checks.sh decode-tests # the decode kernels' GPU tests (~1 min)
#   bash benchmarks/gpu_checks.sh plain-split  # the plain rule's kernel split vs FLA (docs/notes/plain-prefill.md)
#   bash benchmarks/gpu_checks.sh cold         # cold starts of the Gluon paths (first call, empty cache)
#   bash benchmarks/gpu_checks.sh setup        # only the installs (before runs side by side)
#   bash benchmarks/gpu_checks.sh backward     # the Triton backward's GPU tests and its option fuzz (~4 min)
#   bash benchmarks/gpu_checks.sh backward-stages # those tests, and every backward launch's tensors
#                                              # against the interpreter's (benchmarks/backward_stages.py)
#   bash benchmarks/gpu_checks.sh backward-scan  # GDN's dh0 with the reverse scan on tf32 / bf16 operands,
#                                              # KDA's, then the GPU backward tests (~4 min)
#   bash benchmarks/gpu_checks.sh backward-diag  # KDA at K = V = 64: each backward launch against the
#                                              # interpreter's, its gradients under switches; then
#                                              # where GDN's fwd + bwd time goes, fastla's and FLA's
#                                              # (benchmarks/backward_profile.py; ~4 min)
#   bash benchmarks/gpu_checks.sh backward-round # the backward's GPU tests, GDN's fwd + bwd against FLA
#                                              # (backward-bench), its kernels under launch switches
#                                              # (ROW), KDA's kernels (~7 min)
#   bash benchmarks/gpu_checks.sh backward-next  # the backward's GPU tests, then GDN's fwd + bwd kernels
#                                              # against FLA's and KDA's (~6 min, BUDGET s)
#   bash benchmarks/gpu_checks.sh score-sweep  # the score kernel's builds (errors vs fp64, KDA's kernels),
#                                              # then the KDA / GLA backward GPU tests (~6 min, BUDGET s)
#   bash benchmarks/gpu_checks.sh fused-gate   # KDA's gate on gate_grads' kernels in training: GPU tests,
#                                              # gradients and KDA's fwd + bwd kernels off / on (~4 min)
#   bash benchmarks/gpu_checks.sh fuzz-cases   # the training fuzz's fault: one case a process (~4 min)
#   bash benchmarks/gpu_checks.sh localize     # KDA's V = 32 fault and GLA's K = V = 64 dq under knobs
#                                              # and ptxas 12.9 (benchmarks/fuzz_cases.py localize; ~3 min)
#   bash benchmarks/gpu_checks.sh value-fix    # the channel value kernel's fix: the backward's GPU tests
#                                              # and fuzz, GLA's with the plain rule on, KDA's kernel
#                                              # times (~5 min)
#   bash benchmarks/gpu_checks.sh owed         # on an H200 the table below (issues 3 and 4), elsewhere
#                                              # value-fix (~5 min)
#   bash benchmarks/gpu_checks.sh backward-bench # its fwdbwd against FLA on registry shapes (FILTER: which;
#                                              # two GDN ones by default; FLA's backward compiles for
#                                              # minutes without a cache: KDA's tunes ~280 s)
#   bash benchmarks/gpu_checks.sh cold-gates   # KDA's first call with each gate (the registry cold-starts only
#                                              # the bounded one), its compiles serial and side by side
#                                              # (FASTLA_COMPILE_AHEAD=0 / 1, fastla/core/compile_ahead.py)
#   bash benchmarks/gpu_checks.sh regs-rows    # the registry rows whose plan moved onto the state-in-registers
#                                              # scan without a rerun (docs/notes/gdn-prefill.md v26; ~5 min)
#   bash benchmarks/gpu_checks.sh prologue-ab # the KDA prologue's bounded operands and whole chunks, GDN's
#                                              # inverse on ex2.approx.ftz: GPU tests and A/B sweeps (docs/notes/
#                                              # kda-prefill.md v19-v21, gdn-prefill.md v30; ~9 min)
#   bash benchmarks/gpu_checks.sh loads-ahead    # the KDA prologue's loads ahead: their bit-equality
#                                              # tests, then the A/B sweep (~2 min)
#   bash benchmarks/gpu_checks.sh gates-in-scan  # KDA's gates formed in the scan: GPU tests, A/B sweep, then
#                                              # the registry rows the H200 table owes (4 KDA, 10 GDN; ~9.5 min)
#   bash benchmarks/gpu_checks.sh scores-in-scan # GDN's scores formed in the scan: GPU tests and
#                                              # the A/B sweep (docs/notes/gdn-prefill.md v32; ~9 min)
#   bash benchmarks/gpu_checks.sh whole-branches # the scan's row masks skipped on whole chunks: GPU tests
#                                              # and A/B sweeps, KDA and GDN (~8 min)
#   bash benchmarks/gpu_checks.sh beta-in-p    # P diag(beta) from the inverse kernels, the scan's Y without
#                                              # beta: GPU tests and A/B sweeps, KDA and GDN (~8 min)
#   bash benchmarks/gpu_checks.sh a16          # KDA's A scratch in fp16: GPU tests, A/B sweep (~4 min; SHAPES)
#   bash benchmarks/gpu_checks.sh table        # every KDA and GDN forward row of the registry (~6-8 min;
#                                              # AB=0 skips the H200's gaters A/B)
#   bash benchmarks/gpu_checks.sh unbounded    # KDA's softplus gate on the registry's eight rows vs FLA
#                                              # (LEFT: its seconds, 570; rows saved as they finish)
#   bash benchmarks/gpu_checks.sh table-rest   # the table's forward rows gates-in-scan leaves (~4 min)
#   bash benchmarks/gpu_checks.sh graph-eager  # why big rows' graph times exceed their eager ones: five
#                                              # timings, SM clock and power (benchmarks/graph_vs_eager.py; ~3 min)
#   bash benchmarks/gpu_checks.sh kda-rows     # the registry's eight KDA rows (the README table; ~5 min)
#   bash benchmarks/gpu_checks.sh table-rows   # pipeline-rows, then the KDA rows not rerun since v16, in
#                                              # one call (~9.5 min; what fits, largest expected change first)
#   bash benchmarks/gpu_checks.sh pipeline-rows # the GDN rows the pipeline (v27), the state-in-registers
#                                              # scan and the varlen split (v28) took since the H200
#                                              # table's runs (~4.5 min)
# LIMIT: seconds for each test group (420). Run from the repository
# root with .whl/ carried (../shared/device/peer-wheels.sh); results go to $OUT when set (the device
# tool's output folder).
set -uo pipefail
cd "$(dirname "$0")/.."
# (once per machine: a second run beside the first must not rewrite what the first imports)
[ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
[ -d /tmp/tc ] || { mkdir -p /tmp/tc && tar xzf .whl/fla-0.6.0-autotune-h200.tgz -C /tmp/tc; }
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
out=${OUT:-.}
mkdir -p "$out"
# (a group's log: $out/gpu_log.PID.N, N its number, fixed when bg forks, PID this run's, so runs
# side by side keep theirs; its summary lines and exit status in /tmp)
t() {
  echo "== ${*:2}" | cut -c1-150
  local log="$out/gpu_log.$$.$n"
  timeout "$1" python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=line "${@:2}" > "$log" 2>&1
  local rc=$?
  grep -E "^FAILED|^E " "$log" | head -10
  tail -1 "$log"
  if [ "$rc" = 124 ]; then echo "(timed out after $1 s)"; elif [ "$rc" != 0 ]; then echo "(exit $rc)"; fi
  echo "$rc" > "/tmp/gpu_rc.$$.$n"
}
# the test groups run side by side (correctness only; their compiles spread over the host's cores),
# each one's lines printed together once all are done; the script exits 1 if any group failed
n=0
bg() { ( t "$@" > "/tmp/gpu_summary.$$.$n" 2>&1 ) & n=$((n + 1)); }
show() {
  wait
  local worst=0
  for i in $(seq 0 $((n - 1))); do
    cat "/tmp/gpu_summary.$$.$i"
    [ "$(cat "/tmp/gpu_rc.$$.$i" 2>/dev/null)" = 0 ] || worst=1
  done
  return $worst
}
# (seconds of BUDGET (540) still left, from $start that a target sets, above $1)
left() { [ $(( ${BUDGET:-540} - ($(date +%s) - start) )) -gt "$1" ]; }
# (a timeout of $1 s, cut to what is left of the call's 575 s from $start, at least 1)
cap() { local rest=$(( 575 - ($(date +%s) - start) )); echo $(( rest < 1 ? 1 : (rest < $1 ? rest : $1) )); }
# (KDA's gradients against fp64 at B 2 T 400 bf16 under KNOBS $1, one line)
kda_errors() {
  KNOBS=$1 timeout 60 python3 benchmarks/backward_variants.py kda 2 400 bfloat16 1 1 2>&1 | grep "vs fp64" |
    sed 's/.*| vs/vs/; s/| torch tier.*//'
}
case "${1:-tests}" in
  tests)
    # ONLY: which of the groups to run (all by default)
    groups="gluon-gdn gluon-kda plain fuzz triton plans large"
    for g in ${ONLY:-}; do
      [[ " $groups " == *" $g "* ]] || { echo "ONLY: no group $g (groups: $groups)"; exit 2; }
    done
    has() { [[ " ${ONLY:-$groups} " == *" $1 "* ]]; }
    # (two groups: the file's 197 cases ran past 480 s in one on an H100, 195 done)
    kernels="sm90 or scores_in_scan or pipeline or segment_summaries"
    has gluon-gdn && bg "${LIMIT:-420}" tests/ops/test_gluon_chunk_gdn.py -k "$kernels" &&
      bg "${LIMIT:-420}" tests/ops/test_gluon_chunk_gdn.py -k "not ($kernels)"
    has gluon-kda && bg "${LIMIT:-420}" tests/ops/test_gluon_chunk_kda.py
    has plain && bg "${LIMIT:-420}" tests/ops/test_triton_chunk_plain.py tests/ops/test_chunk_vs_reference.py
    # (the fuzz compiles anew for most seeds, ~17 s a case: three groups of twelve)
    fuzz() { for s in $(seq "$2" "$3"); do echo "tests/ops/test_option_fuzz.py::test_gluon_tier_against_fp64[$1-$s]"; done; }
    has fuzz && bg "${LIMIT:-420}" $(fuzz delta 0 11) && bg "${LIMIT:-420}" $(fuzz delta 12 23) &&
      bg "${LIMIT:-420}" $(fuzz plain 0 11)
    # (tests that pick the device inline carry no gpu mark: -m "" keeps them, "not cpu" drops the
    # CPU cases of the device-parametrized ones)
    # (one group a file: together they ran past 380 s on an H100, v27)
    has triton && bg "${LIMIT:-420}" tests/ops/test_triton_chunk_gdn.py -m "" -k "not cpu" &&
      bg "${LIMIT:-420}" tests/ops/test_triton_chunk_kda.py -m "" -k "not cpu"
    has large && bg "${LIMIT:-420}" tests/ops/test_large_offsets.py
    has plans && bg "${LIMIT:-420}" tests/core/test_call_plan.py tests/core/test_compile_ahead.py tests/ops/test_compile.py \
      tests/ops/test_recurrent.py
    show ;;
  decode-tests) bg 300 tests/ops/test_gluon_recurrent.py; show ;;
  plain-split) timeout 300 python3 benchmarks/plain_prefill_split.py --segments 16,32 --out "$out" 2>&1 | tail -30 ;;
  cold)
    timeout 500 python3 -m fastla bench --filter gdn/h16-hv64/1x8192,gdn/h2-hv8/1x32768,kda/h64/1x8192 \
      --modes fwd --quick --cold-all --out "$out" 2>&1 | tail -12
    ;;
  cold-gates)
    for run in "op 0" "op 1" "unbounded 0" "unbounded 1" "given 0" "given 1"; do
      set -- $run
      gate=$1
      FASTLA_COMPILE_AHEAD=$2 TRITON_CACHE_DIR=$(mktemp -d) timeout 120 python3 -c "
import sys, time, torch
sys.path.insert(0, 'benchmarks')
from kda_prefill_sweep import with_gate
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.ops import chunk_kda
kw = with_gate(call_kwargs(make_inputs(get_config('kda/h64/1x8192'), 'cuda')), '$gate')
torch.cuda.synchronize(); start = time.perf_counter()
with torch.no_grad():
    chunk_kda(**kw)
torch.cuda.synchronize(); print('kda/h64/1x8192 gate $gate, compile ahead $2: first call', round(time.perf_counter() - start, 2), 's')
" 2>&1 | tail -1
    done ;;
  backward)
    bg 240 tests/ops/test_triton_chunk_backward.py -m "" -k "not cpu"
    bg 240 tests/ops/test_option_fuzz.py -m "" -k backward_against_fp64_on_gpu; show ;;
  backward-stages)
    # each backward launch's tensors on the GPU against the interpreter's (its products rounded as
    # the GPU's), GDN and KDA at B = 2, T = 400 bf16; the interpreter runs beside the GPU tests
    for op in gdn kda; do
      python3 benchmarks/backward_stages.py run cpu $op 2 400 bfloat16 /tmp/${op}_cpu.pt > /tmp/${op}_cpu.log 2>&1 &
    done
    for op in gdn kda; do timeout 120 python3 benchmarks/backward_stages.py run cuda $op 2 400 bfloat16 /tmp/${op}_gpu.pt 2>&1 | tail -1; done
    bg 240 tests/ops/test_triton_chunk_backward.py -m "" -k "not cpu"; show
    wait
    for op in gdn kda; do
      tail -1 /tmp/${op}_cpu.log
      python3 benchmarks/backward_stages.py compare /tmp/${op}_gpu.pt /tmp/${op}_cpu.pt
    done ;;
  backward-scan)
    # GDN's dh0 with the delta rule's reverse scan as shipped, with DELTA_SCAN_FP32_PRODUCTS=0 and
    # at 32 value columns (its previous shape); KDA's with kept and recomputed states; then the GPU
    # backward tests
    start=$(date +%s)
    for k in "" chunk_delta_backward.DELTA_SCAN_FP32_PRODUCTS=0 chunk_delta_backward.SCAN_BLOCK_V=32; do
      KNOBS=$k timeout 60 python3 benchmarks/backward_variants.py gdn 2 400 bfloat16 1 1 2>&1 | tail -1 | cut -c1-230
    done
    for save in 1 0; do
      timeout 60 python3 benchmarks/backward_variants.py kda 2 400 bfloat16 1 $save 2>&1 | tail -1 | cut -c1-230
    done
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/ops/test_triton_chunk_backward.py \
      -k "(cuda or gpu) and not narrow" 2>&1 | grep -E "^FAILED|passed|failed" | cut -c1-200
    # K = V = 16 and 64 on their own (an illegal access would end the process's CUDA context)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/ops/test_triton_chunk_backward.py \
      -k narrow 2>&1 | grep -E "^FAILED|passed|failed|rror" | cut -c1-200
    echo "-- $(( $(date +%s) - start )) s" ;;
  backward-diag)
    start=$(date +%s)
    HEAD_DIM=64 python3 benchmarks/backward_stages.py run cpu kda 2 400 bfloat16 /tmp/k64_cpu.pt > /tmp/k64_cpu.log 2>&1 &
    HEAD_DIM=64 timeout 120 python3 benchmarks/backward_stages.py run cuda kda 2 400 bfloat16 /tmp/k64_gpu.pt 2>&1 | tail -1
    for v in "1 1" "1 0" "0 1"; do
      HEAD_DIM=64 timeout 60 python3 benchmarks/backward_variants.py kda 2 400 bfloat16 $v 2>&1 | tail -1 | cut -c1-200
    done
    HEAD_DIM=64 FP32_STATES=1 timeout 60 python3 benchmarks/backward_variants.py kda 2 400 bfloat16 1 1 2>&1 | tail -1 | cut -c1-200
    timeout 150 python3 benchmarks/backward_profile.py ${ROW:-gdn/h16-hv32/1x8192} 2>&1 | tail -32
    timeout $(( 560 - ($(date +%s) - start) )) tail --pid=$(jobs -p | head -1) -f /dev/null
    tail -1 /tmp/k64_cpu.log
    python3 benchmarks/backward_stages.py compare /tmp/k64_gpu.pt /tmp/k64_cpu.pt 2>&1 | cut -c1-400
    echo "-- $(( $(date +%s) - start )) s" ;;
  backward-round)
    start=$(date +%s)
    bg 300 tests/ops/test_triton_chunk_backward.py -m "" -k "(cuda or gpu) and not narrow"; show
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/ops/test_triton_chunk_backward.py \
      -k narrow 2>&1 | grep -E "^FAILED|passed|failed|Error:" | cut -c1-200
    FILTER=gdn/h16-hv32/1x8192,gdn/h2-hv8/1x8192 bash "$0" backward-bench
    for k in "" chunk_delta_backward.VALUE_STAGES=3 chunk_delta_backward.VALUE_BLOCK_V=32; do
      echo "== fastla, $k"
      KNOBS=$k FLA=0 TOP=6 timeout 60 python3 benchmarks/backward_profile.py ${ROW:-gdn/h16-hv32/1x8192} 2>&1 | grep -v -E "Warn|_warn_once" | tail -7
    done
    echo "== KDA"
    FLA=0 TOP=12 timeout 90 python3 benchmarks/backward_profile.py kda/h64/1x8192 2>&1 | grep -v -E "Warn|_warn_once" | tail -13
    echo "-- $(( $(date +%s) - start )) s" ;;
  backward-next)
    # the backward's GPU tests in three groups side by side, then GDN's fwd + bwd kernels against
    # FLA's and KDA's (benchmarks/backward_profile.py) while time is left (BUDGET s, 540)
    start=$(date +%s)
    f=tests/ops/test_triton_chunk_backward.py
    bg 220 $f -m "" -k "(cuda or gpu) and not kda and not gla and not narrow"
    bg 220 $f -m "" -k "(cuda or gpu) and (kda or gla) and not narrow"
    bg 220 $f -m "" -k "narrow"
    show
    echo "-- $(( $(date +%s) - start )) s"
    if left 100; then
      echo "== GDN against FLA"
      TOP=6 timeout 100 python3 benchmarks/backward_profile.py gdn/h16-hv32/1x8192 2>&1 | grep -v -E "Warn|_warn_once" | tail -16
    fi
    if left 60; then
      echo "== KDA"
      FLA=0 TOP=6 timeout 60 python3 benchmarks/backward_profile.py kda/h64/1x8192 2>&1 | grep -v -E "Warn|_warn_once" | tail -7
    fi
    echo "-- $(( $(date +%s) - start )) s" ;;
  score-sweep)
    # the score kernel's builds and launch shapes (SCORE_VARIANTS: KNOBS strings, ";"-separated,
    # "" the default): each one's gradients against fp64 (benchmarks/backward_variants.py, KDA B 2
    # T 400 bf16) and its KDA kernels at kda/h64/1x8192 while BUDGET s (540) leave 150; then the
    # per-channel backward's GPU tests (KDA, GLA)
    start=$(date +%s)
    m=chunk_channel_backward
    IFS=';' read -ra variants <<< "${SCORE_VARIANTS:-;$m.SCORE_STAGES=2;$m.SCORE_WARPS=8,$m.SCORE_BLOCK_K=64;$m.SCORE_STAGES=2,$m.SCORE_BLOCK_K=16}"
    for kn in "${variants[@]}"; do
      left 150 || break
      echo "== ${kn:-default}"
      kda_errors "$kn"
      if [ -z "$kn" ]; then       # (the default: every kernel)
        FLA=0 TOP=16 timeout 60 python3 benchmarks/backward_profile.py kda/h64/1x8192 2>&1 | grep -E "^--|^ +[0-9]"
      else
        KNOBS=$kn FLA=0 TOP=3 timeout 60 python3 benchmarks/backward_profile.py kda/h64/1x8192 2>&1 | grep -E "^--|score" | head -3
      fi
    done
    echo "-- $(( $(date +%s) - start )) s"
    bg 220 tests/ops/test_triton_chunk_backward.py -m "" -k "(cuda or gpu) and (kda or gla) and not narrow"
    show
    echo "-- $(( $(date +%s) - start )) s" ;;
  fused-gate)
    # the training path's KDA gate by gate_grads' two kernels (chunk_training.FUSED_KDA_GATE, off
    # until this passes): its GPU tests, then each way KDA's gradients against fp64 (B 2 T 400
    # bf16) and its fwd + bwd kernels at kda/h64/1x8192
    bg 220 tests/ops/test_triton_chunk_backward.py -m "" -k "(fused_kda_gate or kda_everything_in_op) and not cpu"
    show
    for kn in "" chunk_training.FUSED_KDA_GATE=1; do
      echo "== ${kn:-default}"
      kda_errors "$kn"
      KNOBS=$kn FLA=0 TOP=16 timeout 60 python3 benchmarks/backward_profile.py kda/h64/1x8192 2>&1 | grep -E "^--|^ +[0-9]"
    done ;;
  fuzz-cases)
    # the training fuzz's cases one process each, blocking launches: which kernel faults on delta
    # seed 7 and under which of its options (benchmarks/fuzz_cases.py; ~4 min)
    timeout 560 python3 benchmarks/fuzz_cases.py ;;
  localize)
    # the two backward faults one case a process, under the kernels' knobs and ptxas 12.9: every
    # gradient's error (benchmarks/fuzz_cases.py localize; ~3 min)
    timeout 560 python3 benchmarks/fuzz_cases.py localize ;;
  value-fix)
    # the channel value kernel's tiles (chunk_channel_backward.value_block; docs/notes/
    # chunk-backward.md): the backward's GPU tests (their fixture turns every op on: GLA's, Simple
    # GLA's and Lightning's included) and the training fuzz side by side, then KDA's kernel times
    bg 270 tests/ops/test_triton_chunk_backward.py -m "" -k "not cpu"
    bg 270 tests/ops/test_option_fuzz.py -m "" -k backward_against_fp64_on_gpu; show
    FLA=0 TOP=8 timeout 60 python3 benchmarks/backward_profile.py kda/h64/1x8192 2>&1 | grep -v -E "Warn|_warn_once" | tail -9
    ;;
  owed)
    # what the open work owes, by the card drawn: on an H200 the table (issues 3 and 4; `unbounded`
    # in a second call); elsewhere the value kernel's fix (value-fix, ~5 min)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      AB=0 bash benchmarks/gpu_checks.sh table
    else
      bash benchmarks/gpu_checks.sh value-fix
    fi ;;
  backward-bench)
    FASTLA_TRITON_BACKWARD=1 timeout 560 python3 -m fastla bench --filter "${FILTER:-gdn/h16-hv32/1x8192,gdn/h2-hv8/1x8192}" \
      --modes fwdbwd --quick --no-cold --out "$out" 2>&1 | tail -8
    ;;
  prologue-ab)
    # the KDA prologue's bounded operands and unmasked whole chunks (docs/notes/kda-prefill.md
    # v19-v21; both on by default since): the bounded cases against the Triton prologue and fp64
    # with and without them, then the A/B sweep (outputs vs no-from-x); GDN's inverse with
    # ex2.approx.ftz and its merges' operands converted once
    # (docs/notes/gdn-prefill.md v30): its parity tests and sweep. Each step is capped and bounded
    # by what is left of the call's ten minutes (KDA first)
    start=$(date +%s)
    t "$(cap 200)" tests/ops/test_gluon_chunk_kda.py -k "bounded_operands or matches_triton or full_chunks"
    timeout "$(cap 200)" python3 benchmarks/kda_prefill_sweep.py --tier gluon \
      --variants no-from-x,from-x,from-x-full \
      --shapes kda/h64/1x8192,kda/h64/2x16384,kda/h96/varlen8x15193 --out "$out" 2>&1 | tail -16
    n=1 t "$(cap 90)" tests/ops/test_gluon_chunk_gdn.py -k "sm90_inverse"
    left=$(cap 240)
    [ "$left" -gt 30 ] && timeout "$left" python3 benchmarks/gdn_prefill_sweep.py \
      --variants gluon,gluon-inverse-exp2,gluon-inverse-direct,gluon-inverse-exp2-direct \
      --shapes gdn/h16-hv64/1x32768,gdn/h16-hv32/4x8192 --out "$out" 2>&1 | tail -6
    echo "-- $(( $(date +%s) - start )) s"
    ;;
  gates-in-scan)
    # KDA's gated keys and queries formed in the scan (docs/notes/kda-prefill.md v22-v23, on by
    # default where the scan runs one chain, or two planned and one chain's programs fill their last
    # wave): its GPU tests, the A/B sweep, then the registry rows the H200 table owes: the KDA rows
    # it serves and GDN's ten scores-in-scan rows
    start=$(date +%s)
    t "$(cap 180)" tests/ops/test_gluon_chunk_kda.py -k "gates_in_scan"
    timeout "$(cap 150)" python3 benchmarks/kda_prefill_sweep.py --tier gluon \
      --variants ${VARIANTS:-tiles,gates-in-scan,gates-fp32} \
      --shapes ${SHAPES:-kda/h64/1x8192,kda/h64/1x16384} --out "$out" 2>&1 | grep gluon | cut -c1-150
    echo "-- $(( $(date +%s) - start )) s"
    left=$(cap 560)
    [ "$left" -gt 60 ] && timeout "$left" python3 -m fastla bench --filter \
      kda/h64/1x8192,kda/h64/1x16384,kda/h64/2x16384,kda/h96/2x16384,gdn/h16-hv64/1x32768,gdn/h16-hv64/4x8192,gdn/h16-hv32/4x8192,gdn/h16-hv64/varlen9x16384,gdn/h8-hv32/4x8192,gdn/h16-hv64/1x8192,gdn/h16-hv32/varlen9x16384,gdn/h8-hv32/varlen9x16384,gdn/h4-hv16/4x8192,gdn/h4-hv16/varlen9x16384 \
      --modes fwd --quick --no-cold --out "$out" 2>&1 | tail -14
    echo "-- $(( $(date +%s) - start )) s"
    ;;
  loads-ahead)
    # the KDA prologue's loads ahead (kda-prefill.md v23): the bit-equality tests, then the A/B sweep
    start=$(date +%s)
    t "$(cap 200)" tests/ops/test_gluon_chunk_kda.py -k "prologue_loads_ahead"
    timeout "$(cap 150)" python3 benchmarks/kda_prefill_sweep.py --tier gluon --variants default,loads-late \
      --shapes kda/h64/1x8192,kda/h64/2x16384 --out "$out" 2>&1 | grep gluon | cut -c1-150
    echo "-- $(( $(date +%s) - start )) s"
    ;;
  scores-in-scan)
    # GDN's scores formed in the scan (docs/notes/gdn-prefill.md v32): its GPU tests, the inverse's
    # parity tests (it writes the norms now), then the A/B sweep against the scores kernel on the
    # shapes it serves
    start=$(date +%s)
    t "$(cap 260)" tests/ops/test_gluon_chunk_gdn.py -k "scores_in_scan or (sm90_inverse and default)"
    left=$(cap 200)
    [ "$left" -gt 30 ] && timeout "$left" python3 benchmarks/gdn_prefill_sweep.py \
      --variants gluon,gluon-scores-kernel \
      --shapes gdn/h16-hv64/1x32768,gdn/h16-hv32/4x8192,gdn/h16-hv64/varlen9x16384 \
      --out "$out" 2>&1 | tail -14
    echo "-- $(( $(date +%s) - start )) s"
    # then, in what is left, the registry rows it serves (the default since v32)
    left=$(cap 560)
    [ "$left" -gt 60 ] && timeout "$left" python3 -m fastla bench --filter \
      gdn/h16-hv64/1x32768,gdn/h16-hv64/4x8192,gdn/h16-hv32/4x8192,gdn/h16-hv64/varlen9x16384,gdn/h8-hv32/4x8192,gdn/h16-hv64/1x8192,gdn/h16-hv32/varlen9x16384,gdn/h8-hv32/varlen9x16384,gdn/h4-hv16/4x8192,gdn/h4-hv16/varlen9x16384 \
      --modes fwd --quick --no-cold --out "$out" 2>&1 | tail -10
    echo "-- $(( $(date +%s) - start )) s"
    ;;
  whole-branches)
    # the state-in-registers scan's row masks behind branches that whole chunks skip (kda-prefill.md
    # v24, WHOLE_CHUNK_BRANCHES): the KDA gaters' and GDN's scores-in-scan GPU tests side by side
    # (partial last chunks, varlen, length-1 sequences), then the A/B sweeps
    start=$(date +%s)
    n=1; t "$(cap 250)" tests/ops/test_gluon_chunk_kda.py -k "gates_in_scan" > /tmp/wb1.txt 2>&1 &
    n=2; t "$(cap 250)" tests/ops/test_gluon_chunk_gdn.py -k "scores_in_scan or (lengths and regs) or (varlen and regs)" > /tmp/wb2.txt 2>&1 &
    wait; cat /tmp/wb1.txt /tmp/wb2.txt
    echo "-- $(( $(date +%s) - start )) s"
    timeout "$(cap 170)" python3 benchmarks/kda_prefill_sweep.py --tier gluon --variants default,masks-always \
      --shapes ${SHAPES:-kda/h64/1x8192,kda/h64/2x16384} --out "$out" 2>&1 | grep gluon | cut -c1-150
    timeout "$(cap 150)" python3 benchmarks/gdn_prefill_sweep.py --variants gluon,gluon-masks-always \
      --shapes gdn/h16-hv64/1x32768,gdn/h16-hv32/4x8192 --out "$out" 2>&1 | tail -6
    echo "-- $(( $(date +%s) - start )) s"
    ;;
  beta-in-p)
    # the inverse kernels write P diag(beta) where the scan forms GDN's scores or KDA's gated keys,
    # and the chain's Y skips beta (gluon/chunk_delta.BETA_IN_P; gdn-prefill.md v36, kda-prefill.md
    # v27): the GPU tests of both plans, the inverse kernels' (the KDA one against fp64 with the
    # columns scaled), the pipeline's and the call plans' replays, side by side; then the A/B sweeps
    start=$(date +%s)
    n=1; t "$(cap 250)" tests/ops/test_gluon_chunk_kda.py -k "gates_in_scan" > /tmp/bp1.txt 2>&1 &
    n=2; t "$(cap 250)" tests/ops/test_gluon_chunk_gdn.py -k "scores_in_scan or pipeline" > /tmp/bp2.txt 2>&1 &
    n=3; t "$(cap 250)" tests/ops/test_triton_chunk_kda.py tests/core/test_call_plan.py -m "" \
      -k "inverse_kernel or on_gpu" > /tmp/bp3.txt 2>&1 &
    n=4; t "$(cap 250)" tests/ops/test_gluon_chunk_gdn.py -k "sm90_inverse and default" > /tmp/bp4.txt 2>&1 &
    wait; cat /tmp/bp1.txt /tmp/bp2.txt /tmp/bp3.txt /tmp/bp4.txt
    echo "-- $(( $(date +%s) - start )) s"
    timeout "$(cap 170)" python3 benchmarks/kda_prefill_sweep.py --tier gluon --variants default,beta-in-scan \
      --shapes ${SHAPES:-kda/h64/1x8192,kda/h64/2x16384} --out "$out" 2>&1 | grep gluon | cut -c1-150
    timeout "$(cap 200)" python3 benchmarks/gdn_prefill_sweep.py --variants gluon,gluon-beta-in-scan \
      --shapes gdn/h16-hv64/1x32768,gdn/h16-hv32/4x8192,gdn/h16-hv64/1x8192 --out "$out" 2>&1 | tail -8
    echo "-- $(( $(date +%s) - start )) s"
    ;;
  table)
    # every KDA then every GDN forward row of the registry (the README table's owed rows, KDA's goals
    # first), in one call: ~10 s a row with FLA's tuning cache, ~6-8 min
    # (on an H200 first the gaters' A/B, measured on H100s only: docs/notes/kda-prefill.md v22-v23)
    start=$(date +%s)
    [ "${AB:-1}" = 1 ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && timeout 150 python3 benchmarks/kda_prefill_sweep.py \
      --tier gluon --variants tiles,gates-in-scan --shapes kda/h64/1x8192,kda/h64/2x16384 --out "$out" 2>&1 | grep gluon | cut -c1-150
    timeout 300 python3 -m fastla bench --filter kda/ --modes fwd --quick --no-cold --out "$out" 2>&1 | grep "|" | tail -9
    timeout $(( 585 - ($(date +%s) - start) )) python3 -m fastla bench --filter gdn/ --modes fwd --quick --no-cold \
      --out "$out" 2>&1 | grep "|" | tail -21 ;;
  a16)
    # KDA's A scratch in fp16 where |A| <= 2 (chunk_prepare_kda_sm90.A_FP16, docs/notes/kda-prefill.md
    # v32): its GPU test (the error against fp64 beside the fp32 scratch's), then the A/B sweep
    start=$(date +%s)
    t 200 tests/ops/test_gluon_chunk_kda.py -k "a_scratch_fp16 or (bf16_cases and bounded)"
    timeout $(( 560 - ($(date +%s) - start) )) python3 benchmarks/kda_prefill_sweep.py --tier gluon \
      --variants a-fp32,a-fp16,a-fp32,a-fp16 --shapes ${SHAPES:-kda/h64/1x8192,kda/h64/2x16384,kda/h96/1x8192,kda/h64/varlen8x15193} \
      --out "$out" 2>&1 | grep gluon | cut -c1-150
    left=$(( 570 - ($(date +%s) - start) ))
    mkdir -p "$out/unbounded"
    [ "$left" -gt 40 ] && timeout "$left" python3 benchmarks/kda_prefill_sweep.py --tier gluon --gate unbounded \
      --variants a-fp32,a-fp16 --shapes kda/h64/1x8192 --out "$out/unbounded" 2>&1 | grep gluon | cut -c1-150
    echo "-- $(( $(date +%s) - start )) s" ;;
  table-rest)
    # the H200 table's forward rows that gates-in-scan does not rerun (run it first; with it, every
    # GDN and KDA forward row of the registry on the current code; ~4 min with FLA's tuning cache)
    timeout 570 python3 -m fastla bench --filter \
      gdn/h16-hv32/1x32768,gdn/h16-hv32/1x8192,gdn/h8-hv32/1x32768,gdn/h8-hv32/1x8192,gdn/h4-hv16/1x32768,gdn/h4-hv16/1x8192,gdn/h2-hv8/,kda/h64/varlen8x15193,kda/h96/1x8192,kda/h96/1x16384,kda/h96/varlen8x15193 \
      --modes fwd --quick --no-cold --out "$out" 2>&1 | tail -16 ;;
  graph-eager)
    timeout 500 python3 benchmarks/graph_vs_eager.py --out "$out" 2>&1 | tail -8 ;;
  regs-rows)
    timeout 560 python3 -m fastla bench --filter gdn/h16-hv64/1x8192,gdn/h16-hv32/varlen9x16384,gdn/h8-hv32/varlen9x16384,gdn/h4-hv16/varlen9x16384,gdn/h4-hv16/4x8192,kda/h64/1x16384,kda/h64/varlen8x15193,kda/h96/1x16384,kda/h96/2x16384,kda/h96/varlen8x15193 \
      --modes fwd --quick --no-cold --out "$out" 2>&1 | tail -14
    ;;
  kda-rows)
    timeout 560 python3 -m fastla bench --filter kda/ --modes fwd --quick --no-cold --out "$out" 2>&1 | tail -12
    ;;
  table-rows)
    # pipeline-rows and kda-rows in one call, the rows whose H100 runs moved most first; each group
    # stops when the call's ten minutes would; records are saved a row at a time
    start=$(date +%s)
    rows() {
      local left=$(( 570 - ($(date +%s) - start) ))
      [ "$left" -gt 30 ] || return 0
      timeout "$left" python3 -m fastla bench --filter "$1" --modes fwd --quick --no-cold --out "$out" 2>&1 | tail -7
      echo "-- $(( $(date +%s) - start )) s"
    }
    rows gdn/h16-hv32/1x32768,gdn/h8-hv32/1x32768,gdn/h8-hv32/varlen9x16384,gdn/h2-hv8/varlen9x16384,gdn/h16-hv32/1x8192
    rows gdn/h8-hv32/1x8192,gdn/h16-hv32/varlen9x16384,gdn/h4-hv16/varlen9x16384,gdn/h16-hv64/1x8192,gdn/h4-hv16/4x8192
    rows kda/h64/1x16384,kda/h96/1x16384,kda/h96/2x16384,kda/h96/varlen8x15193,kda/h64/varlen8x15193
    ;;
  pipeline-rows)
    timeout 560 python3 -m fastla bench --filter gdn/h16-hv32/1x8192,gdn/h16-hv32/1x32768,gdn/h8-hv32/1x8192,gdn/h8-hv32/1x32768,gdn/h16-hv64/1x8192,gdn/h16-hv32/varlen9x16384,gdn/h8-hv32/varlen9x16384,gdn/h4-hv16/varlen9x16384,gdn/h4-hv16/4x8192,gdn/h2-hv8/varlen9x16384 \
      --modes fwd --quick --no-cold --out "$out" 2>&1 | tail -14
    ;;
  unbounded)
    # KDA's unbounded (softplus) gate on the registry's eight rows, fastla's sm_90 tier and FLA in one
    # process (issue 4 asks >= 1.5x on the same configs; docs/notes/kda-prefill.md v34, an H100's)
    timeout ${LEFT:-570} python3 benchmarks/kda_prefill_sweep.py --tier gluon --gate unbounded --variants default \
      --shapes kda/h64/1x8192,kda/h64/2x16384,kda/h96/1x8192,kda/h64/varlen8x15193,kda/h64/1x16384,kda/h96/1x16384,kda/h96/varlen8x15193,kda/h96/2x16384 \
      --out "$out" 2>&1 | grep gluon | cut -c1-150 ;;
  setup) ;;
esac
