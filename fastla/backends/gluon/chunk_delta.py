"""The Gluon tier's GDN and KDA chunked forwards: the Triton prologue, segment summaries and
combine (backends/triton/chunk_delta.py), with the sequence passes of the scan in an sm_90 kernel:
the two-chain scan (chunk_delta_dual_sm90.py) where it serves, else the one-chain scan
(chunk_delta_sm90.py; KDA's 32 columns, chunk states stored), both with KDA's per-channel ``GK``
step. The plain rule (GLA, Simple GLA, Lightning) runs the same scans without the delta
correction (``DELTA`` False): for a scalar gate over the Triton gate cumsum and GDN's sm_90 scores
kernel, for GLA over KDA's sm_90 prologue without A (and no inverse)."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math

import torch

from fastla.backends.gluon import available
from fastla.backends.triton import chunk_delta as triton_chunk
from fastla.backends.triton import sm_count
from fastla.backends.triton.launch import launcher
from fastla.core.problem import Problem

SCAN_BLOCK_V = None         # value columns per program (None: scan_tile's plan)
SCAN_STAGES = 2             # chunks of tiles in flight
SCAN_WARPGROUPS = None      # warpgroups splitting a program's columns (None: scan_tile's plan)
# The warp-specialized scan (chunk_delta_ws_sm90.py) at the widths it fits (shared memory: 164 and
# 200 KB at K = 128): off by default, it measured 4-10% slower than the plain scan at 64 columns
# on every swept shape (docs/notes/gdn-prefill.md, v10)
SCAN_SPECIALIZED = False
# Two chains per program (chunk_delta_dual_sm90.py: the program's columns as two halves, each on
# its own warpgroup, and a loader warp) at the widths where it measured faster than the plain
# kernel (docs/notes/gdn-prefill.md, v11): every GDN width (32 columns 6-10% faster a step, 64 and
# 128 14%), KDA's 64 (15%; at 32 it lost 35%). False: the plain kernel everywhere (A/B sweeps)
SCAN_DUAL = True
# The two-chain scan's registers per thread at launch (None: the compiler's, the whole register
# file at 384 threads): a lower cap leaves room on each SM for other kernels' programs (sweeps)
SCAN_MAXNREG = None
DUAL_WIDTHS = {False: (32, 64, 128), True: (64,)}       # by GK
# The state in registers (chunk_delta_regs_sm90.py: every product transposed so that the state and
# the step's intermediates are wgmma operands in registers, no shared-memory round trips; one or two
# 64-column chains a program and a loader warp) for the delta rule's whole sequences (GDN, KDA)
# without chunk states, where ``regs_chains`` plans it. Measured on an H100 against the two-chain
# scan (docs/notes/gdn-prefill.md v26, scan us): one chain where its programs fill one wave (1x32k
# HV64 941 -> 906, KDA 1x8k H64 320 -> 300), two where they would take more (4x8k HV32 H8 385 ->
# 348, varlen 9x16k HV64 415 -> 381, KDA 2x16k H64 1264 -> 1126; on the H200 1x32k HV64 945.5 ->
# 783.8); fewer lanes stay on the two-chain scan's narrower tiles. False: the two-chain scan
# everywhere (A/B)
SCAN_REGS = True
REGS_CHAINS = None          # chains a program: None, the plan; 1 or 2 forced wherever it serves (sweeps, tests)
# GDN's prologue under the scan (``pipeline_pieces``, ``_run_pipelined``): where the one-chain scan's
# 64-column programs take at most half the SMs (one sequence, HV <= 32 at V = 128), the sequence
# runs as pieces of whole chunks, each piece's inverse and scores kernels on a side stream and its
# scan on the caller's, the state carried between pieces: a piece's prologue runs on the idle SMs
# under the previous piece's scan. The probe's bound on an H100 (benchmarks/gdn_overlap_probe.py:
# the whole prologue beside the one-chain scan, unsynchronized) h16-hv32/1x8192 277.7 -> 213.5 us,
# 1x32768 1074.5 -> 954.2. Measured on an H100 (gdn_prefill_sweep.py, CUDA graph, us, against
# PIPELINE False; docs/notes/gdn-prefill.md v27): h16-hv32/1x8192 280.2 -> 260.6 (two pieces; four
# 265.8, eight 272.1), h8-hv32/1x8192 259.4 -> 236.4 (two), h16-hv32/1x32768 1074.7 -> 933.8 (four;
# two 974.8, eight 946.2). PIPELINE_PIECES forces the pieces (sweeps, tests; 1: off)
PIPELINE = True
PIPELINE_PIECES = None
PIECES = 4                  # pieces of the plan, each at least PIECE_CHUNKS chunks
PIECE_CHUNKS = 64
# The segment summary pass (sequence parallelism) on the two-chain scan too (its SEG 1: the V + K
# columns from [0 | I], no queries, scores nor output) instead of the Triton scan: 1x32k HV8 442 ->
# 327 us, 1x32k HV16 778 -> 557 (docs/notes/gdn-prefill.md, v12). False: the Triton summary (A/B)
SUMMARY_SM90 = True
# With it, a split pays at a higher predicted cost (triton_chunk.segment_length's gain; the Triton
# summary's is 0.4): 1x8k HV16 (model 0.44 at 16 chunks) 212 -> 182 us split
# (gdn_prefill_sweep-v14-summary.json). Varlen 9x16k HV8, whole in v14 (the waves model counted
# every sequence as long as the longest, and the summary pass took every segment), splits at 24
# chunks since v28 (model 53 / 110 steps; H100 194.5 -> 173.9 us, 218.7 with every segment's
# summary; 16 chunks 213.5, 32 183.8); HV16 stays whole (69 / 110; 243.8 vs 340.9 split at 24,
# gdn_prefill_sweep-v28-*-h100.json)
SEGMENT_GAIN_SM90 = 0.5
# The segment combine (Triton) on sm_90: 8 warps, two stages; 1x32k HV8 46 -> 38 us, 1x8k HV8
# 22 -> 18 (gdn_prefill_sweep-v16-combine.json; outputs bit-equal); 16 value columns a program (twice
# the programs, half the product a step): 1x32k HV8 34.7 -> 29.5 us, 1x8k HV8 16.4 -> 13.9, 1x8k
# HV16 18.7 -> 18.0; 64 columns 50.0 / 23.3 / 26.7 (gdn_prefill_sweep-v20-combine.json). The next
# summary loaded into registers a step ahead measured no faster (-v20-combine-prefetch.json; removed)
COMBINE_WARPS = 8
COMBINE_STAGES = 2
COMBINE_BLOCK_V = 16
# KDA's prologue on the sm_90 kernel (chunk_prepare_kda_sm90.py) where it serves (K % 32 == 0, a
# bf16 or fp32 gate), else on the Triton one (backends/triton/chunk_prepare_kda.py); False for A/B sweeps
KDA_PROLOGUE_SM90 = True
# GDN's scores on the sm_90 kernel (chunk_scores_sm90.py; 1x32k HV64 218 -> 190 us, gdn_prefill_sweep-
# v17-scores-sm90.json), else on the Triton one (backends/triton/chunk_prepare.py); False for A/B sweeps
GDN_SCORES_SM90 = True
# GDN's inverse on the sm_90 kernel (chunk_inverse_sm90.py; 1x32k HV64 397 -> 363 us, gdn_prefill_
# sweep-v18-inverse-sm90.json), else on the Triton one (backends/triton/chunk_prepare.py); False for A/B
GDN_INVERSE_SM90 = True
# Its A blocks' e^(G_i - G_j) on ex2.approx.ftz (chunk_inverse_sm90._a_block: gl.exp rescales
# exponents below -126 for subnormal results): the per-head loop's sm_90 SASS 2567 -> 2359
# instructions, stack 104 -> 88 bytes (docs/notes/gdn-prefill.md v30); off until its GPU tests
# (`-k sm90_inverse`) and sweep (`gdn_prefill_sweep.py --variants gluon,gluon-inverse-exp2`) have run
INVERSE_EXP2 = False
# Its merges' diagonal operands loaded from shared memory in their operand layouts, not converted
# from the accumulator layout (chunk_inverse_sm90._lower_inverse's DIRECT: per-head loop 2567 ->
# 2441 instructions, stack 104 -> 48 bytes); off until its GPU tests and sweep
# (`gluon-inverse-direct`) have run (gdn-prefill.md v30)
INVERSE_DIRECT_OPERANDS = False
# GDN's scores formed in the state-in-registers scan (chunk_delta_regs_sm90._form_scores: Q K^T by
# wgmma from the stage's tiles, weighted in the exponent; with one chain by a scorer warpgroup of
# its own, with two by the second chain for both) instead of written by the scores kernel and read
# back; the inverse kernel writes 1 / |q| and 1 / |k| instead. Where every pass of the call runs
# that scan (``scores_in_scan``; not the pipeline's pieces, whose scores kernel runs on idle SMs).
# Measured (docs/notes/gdn-prefill.md v32, gdn_prefill_sweep-v32-scorer-h100.json, an H100, CUDA
# graph, us): 1x32k HV64 1461.2 -> 1310.3, 4x8k HV32 736.5 -> 635.5, 4x8k HV64 1285.4 -> 1126.8,
# varlen 9x16k HV64 685.6 -> 628.1. False: the scores kernel (A/B)
SCORES_IN_SCAN = True
# KDA's gated keys and queries formed in the state-in-registers scan from q, k and the gate's input
# (chunk_delta_regs_sm90._gater_t: K / 64 gater warpgroups beside one chain, the key, query and kd
# tiles in a ring of three slots gated in place; the chain weights by the rows' norms, which the
# prologue writes) instead of written by the sm_90 prologue and read back: the prologue's stores
# a chunk and head 120 -> 72 KB, the scan's reads unchanged. Where ``gates_in_scan`` plans it
# (the bounded gate, the scan on one chain). Measured on an H100 (kda_prefill_sweep-v22-gates-
# one-chain-h100.json, CUDA graph, us, docs/notes/kda-prefill.md v22): 1x8k H64 788.7 -> 740.6,
# 1x16k H64 1569.5 -> 1469.8. False: the prologue's tiles (A/B)
GATES_IN_SCAN = True
# Where the scan forms GDN's scores or KDA's gated keys (the plans above), the inverse kernel writes
# P diag(beta) instead of P, each block's columns scaled before its one bf16 rounding, and the
# chain's Y = v - X diag(w) skips beta (32 FMUL and the vector's loads a step off the chain, which
# paces the one-chain step: docs/notes/gdn-prefill.md v35-v36). False: beta applied in the scan (A/B)
BETA_IN_P = True
# With it, the gaters' three products on bf16 pairs (chunk_delta_regs_sm90._gater_t's PACKED: HMUL2 /
# HFMA2 on the raw bf16 tiles, 2^G and 2^(G_last - G) rounded to bf16 first, one rounding more an
# element of kg, qg and kd; the gater loop 776 -> 614 SASS instructions). Measured on an H100
# (kda_prefill_sweep-v23-gates-packed-one-chain-h100.json, CUDA graph, us): 1x8k H64 741.8 -> 737.4, 1x16k
# H64 1476.1 -> 1467.4; the output 5.8e-4 -> 6.1e-4 from the tiles path (relative RMS), 4.6e-3
# from FLA either way. False: the products in fp32 (A/B)
GATER_PACKED = True
# Where the plan takes two chains a program, the gaters' one-chain scan still where its programs
# (lanes x V / 64) fill their last SM wave to at least this fraction: the second chain's registers
# hide less than the prologue's stores save only when no wave runs part-empty. Measured on an H100
# (kda_prefill_sweep-v23-gates-packed-one-chain-h100.json, CUDA graph, us; one-chain programs' fill):
# 2x16k H64 (0.97) 3045.5 -> 2986.2, 1x8k H96 (0.73) 1157.9 -> 1286.7, varlen 8x15193 H64 (0.71)
# 1441.6 -> 1482.3
GATES_WAVE_FILL = 0.9
# The state-in-registers scan's per-row masks behind branches that whole chunks skip (the kernel's
# WHOLE): the gaters' sigmoid select (gater loop ~620 -> ~525 instructions a chunk) and the chain's
# masked output stores (issued a chunk: chain ~810 -> ~660 at KDA's gates, ~745 -> ~620 at GDN's one chain;
# not the second chain with the scores, which the branch makes spill in its loop). Bit-equal.
# False: the masks issued on every chunk, predicated (A/B)
WHOLE_CHUNK_BRANCHES = True
SPECIALIZED_WIDTHS = (32, 64)
# q, k and v views whose rows collapse into one strided [B * T, heads * D] array (split from one
# projection: unit inner stride, heads adjacent, batch stride T token strides, 16-byte aligned base
# and row stride) read in place by the TMA descriptors, where every kernel of the call reads them
# through TMA (``in_place_views``), instead of through dense copies: bit-equal, and 160 us of copies
# fewer at gdn h16-hv32 1x8192, 465 at kda h64 1x8192 (strided_inputs-v23.json). False for A/B
STRIDED_TMA = True
# Whole varlen sequences scanned longest first (chunk_delta_sm90._program; the order is
# triton_chunk._varlen_index's): with the sequences as given, a long one's later value tiles can
# wait behind a wave of short ones. False: the given order (A/B sweeps)
LONGEST_FIRST = True

# Time of one chunk step of a program at each tile width (us, H200, K = V = 128 (applied to K = 64
# too, unmeasured there), a full grid, one program per SM at every width), on the shipped kernels
# (the two-chain scan; gdn_prefill_sweep-v13-dual*.json): 32 columns ~1.4 (1x32k HV32: 720 us /
# 512 steps; 1x8k HV32 1.44), 64 ~1.9 (1x32k HV64: 981 / 512), 128 ~2.8 (4x8k HV32: 354 / 128).
# Wider tiles do more columns per step, narrower ones step faster. (The plain kernel's, v9: 1.3 /
# 2.2 / 3.1 on two warpgroups at 128.)
STEP_US = {32: 1.4, 64: 1.9, 128: 2.8}
WARPGROUPS = {32: 1, 64: 1, 128: 2}     # the plain kernel: 128 columns on one warpgroup need > 255 registers
# KDA's GK step loads a third K-wide tile (kd) per chunk: 128 columns would need 245 KB of shared
# memory. 64 columns (two chains) ~2.3 us (1x8k H64: scan 294 us / 128 chunks; H96 597 / 256),
# 32 columns (plain) ~2.5 us (inferred: 1x8k H96 ran three waves of 32-column programs in ~960 us
# once the prologue, scaled from H64, is taken off; benchmarks/results/kda_prefill_sweep-v3-gluon.txt,
# nvidia-h200-20261203-150351.json)
GK_WIDTHS = {32: 2.5, 64: 2.3}


def scan_tile(lanes: float, V: int, sms: int, widths=STEP_US) -> tuple[int, int]:
    """(value columns, warpgroups) per program: the width whose waves of programs (one per SM)
    times its step time is least, for ``lanes`` = value heads x sequences (weighted by length:
    total chunks over the longest sequence's). Measured on the one-chain scan (v9.2): 1x32k HV64
    (64 lanes) 64 columns, one wave of 128 programs (scan 1.14 ms) against two at 32 (1.72) and a
    half-empty one at 128 (1.58); 4x8k HV32 (128 lanes) 128 columns, one wave (0.40 ms vs 0.54 at
    64); 1x8k HV16 (16 lanes) 32 columns (0.17 ms vs 0.23 at 64); the two-chain scan keeps those
    choices (v11: 0.98, 0.35 and 0.17 ms). When the narrowest width fits in one wave it is
    taken whatever the full-grid step times say: lightly loaded, 32 columns step in 1.33 us
    against 1.67 at 64 on two chains (1x8k HV16, v11), and KDA's full-grid times (2.5 at 32,
    2.3 at 64) would otherwise send its few-lane calls to 64."""
    fitting = [bv for bv in widths if V % bv == 0]
    if fitting and lanes * (V // min(fitting)) <= sms:
        bv = min(fitting)
        return bv, WARPGROUPS[bv]
    best = None
    for bv, step in widths.items():
        if V % bv:
            continue
        cost = math.ceil(lanes * (V // bv) / sms) * step
        if best is None or cost < best[0]:
            best = (cost, bv)
    bv = best[1] if best else 32
    return bv, WARPGROUPS[bv]


def summaries_sm90(p: Problem) -> bool:
    """Whether the segment summaries run on the two-chain scan (SUMMARY_SM90): its widths for a
    summary's V + K columns are DUAL_WIDTHS (64 only with a per-channel gate, so V = 32 or 96 with
    GK takes the Triton summary)."""
    widths = DUAL_WIDTHS[p.gk is not None]
    return SUMMARY_SM90 and SCAN_DUAL and any((p.V + p.K) % bv == 0 and p.V % (bv // 2) == 0 for bv in widths)


def plan(p: Problem) -> triton_chunk.ChunkConfig:
    """The launch plan of the Triton chunked forward's driver, split with this tier's summary cost;
    the segment combine at COMBINE_WARPS, COMBINE_BLOCK_V columns, with its next summary
    prefetched (two stages: 144 KB of shared memory at K = 128 and 16 columns, an H200's; the
    portable default stays at one stage and 32 columns)."""
    summaries = summaries_sm90(p)
    config = triton_chunk.default_config(p, segment_gain=SEGMENT_GAIN_SM90 if summaries else None)
    return dataclasses.replace(config, combine_warps=COMBINE_WARPS, combine_stages=COMBINE_STAGES,
                               combine_block_v=COMBINE_BLOCK_V)


def supports(p: Problem) -> str | None:
    reason = available(p.device)
    if reason:
        return reason
    reason = triton_chunk.supports(p, plan(p))
    if reason:
        return f"the Triton prologue cannot serve it: {reason}"
    if any(x.dtype != torch.bfloat16 for x in (p.q, p.k, p.v)):
        return "q, k, v are not bfloat16 (the sm_90 scan loads bf16 tiles)"
    if p.K not in (64, 128):
        return f"K = {p.K} (the sm_90 scan takes K = 64 or 128)"
    if p.V % 32:
        return f"V = {p.V} (the sm_90 scan takes multiples of 32)"
    if p.B * p.T < 64:
        return f"{p.B * p.T} tokens in the batch (the scan's TMA boxes are 64 rows; smaller batches are not validated)"
    return None


@functools.lru_cache(maxsize=None)
def _tile_layout(rows: int, cols: int, fp32: bool = False):
    """The swizzled shared layout of a bf16 (or fp32) TMA tile (cached: ~10 us a call to build)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float32 if fp32 else gl.bfloat16)


def row_stride(x) -> int | None:
    """The row stride (elements) of ``x`` ``[B, T, heads, D]`` read as a ``[B * T, heads * D]``
    array (unit inner stride, heads adjacent, the batch stride T token strides), when TMA can
    read it in place (16-byte aligned base and row stride), else None. A contiguous ``x``'s is
    ``heads * D``."""
    if x.dim() != 4:
        return None
    B, T, heads, D = x.shape
    sb, st, sh, sd = x.stride()
    row = st if T > 1 else (sb if B > 1 else heads * D)
    dense_rows = (D == 1 or sd == 1) and (heads == 1 or sh == D) and (B == 1 or T == 1 or sb == T * st)
    size = x.element_size()
    if not dense_rows or row < heads * D or row * size % 16 or x.data_ptr() % 16:
        return None
    return row


def tma_descriptor(x, rows: int, width: int, block, layout):
    """A TMA descriptor of ``x`` read as [rows, width] in ``block`` boxes: the fields
    TensorDescriptor.from_tensor sets, without its re-validation (~5 us a descriptor; run's
    inputs are dense and 16-byte aligned (triton_chunk.dense_inputs) but for the views kept in
    place (``row_stride``), dtypes are checked in supports, and for the KDA gate in
    chunk_prepare_kda_sm90.serves) and without a view: the launch reads only the base's address
    and dtype, and the shape and strides given here."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows_of_heads = x.dim() == 4 and x.shape[2] * x.shape[3] == width           # a [B, T, heads, D] view's rows
    stride = width if x.is_contiguous() else (row_stride(x) if rows_of_heads else None)
    if stride is None or x.numel() != rows * width:
        raise RuntimeError(f"a TMA descriptor needs a contiguous tensor of {rows} x {width} elements or a view of "
                           f"its rows, got shape {list(x.shape)} with strides {list(x.stride())}")
    d = TensorDescriptor.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = x, (rows, width), (stride, 1), block, layout, "zero"
    return d


def in_place_views(p: Problem) -> tuple[str, ...]:
    """The q, k, v views that this call's kernels can read in place (STRIDED_TMA): the row views
    (``row_stride``) among them when every kernel that reads them loads them by TMA: the sm_90
    scan and summaries, GDN's sm_90 scores and inverse, KDA's sm_90 prologue without the
    wide-block rewrite (which reads q and k by pointer); none otherwise, and none for the plain
    rule (GLA, Simple GLA, Lightning), whose in-place reads have not run on a GPU yet."""
    from fastla.backends.gluon import chunk_prepare_kda_sm90 as kda_prologue
    from fastla.backends.triton.chunk_prepare_kda import bounded_spans

    if not (STRIDED_TMA and p.delta and summaries_sm90(p)):
        return ()
    if p.gk is None and not (GDN_SCORES_SM90 and GDN_INVERSE_SM90):
        return ()
    if p.gk is not None and not (KDA_PROLOGUE_SM90 and kda_prologue.serves(p) is None and bounded_spans(p)):
        return ()
    return tuple(n for n in ("q", "k", "v") if not getattr(p, n).is_contiguous() and row_stride(getattr(p, n)))


def _or_dummy(sp: triton_chunk.SequencePass, *tensors):
    """The tensors a scan launch takes, the pass's dummy standing in for those absent."""
    return [sp.dummy if x is None else x for x in tensors]


def whole_lanes(p: Problem, counts) -> float:
    """Lanes of a whole-sequence pass for the scans' plans: value heads times the sequences'
    chunks over the longest one's (``counts``: chunks a sequence)."""
    return p.HV * sum(counts) / max(max(counts), 1)


def regs_chains(p: Problem, seg: int, chunk_states: bool, lanes: float, sms: int) -> int:
    """Chains a program of the state-in-registers scan for this pass, 0 where the two-chain scan
    runs it. It serves the delta rule (GDN, KDA) without chunk states, whole sequences or (forced)
    segment replays, V a multiple of 64 (128 for two chains). The plan (REGS_CHAINS None), for
    whole sequences: one chain when its 64-column programs (``lanes`` x V / 64) fill between half
    an SM wave and one; two when they would take more than one wave; else 0 (few lanes: the
    two-chain scan's 32-column tiles, and segment replays, whose split its cost model planned)."""
    if not (SCAN_REGS and p.delta and seg != 1 and not chunk_states and p.V % 64 == 0):
        return 0
    if REGS_CHAINS:
        return REGS_CHAINS if p.V % (64 * REGS_CHAINS) == 0 else 1
    programs = lanes * p.V / 64
    if seg or programs < sms / 2:
        return 0
    return 2 if programs > sms and p.V % 128 == 0 else 1


def _sequence_scan(p: Problem, sp: triton_chunk.SequencePass, seg: int, segments, seg_state, programs: int,
                   chains: int | None = None):
    from fastla.backends.gluon.chunk_delta_sm90 import _scan_sm90_kernel
    from fastla.backends.gluon.chunk_delta_dual_sm90 import CHAIN_REGS, LOADER_REGS, _scan_dual_sm90_kernel
    from fastla.backends.gluon.chunk_delta_ws_sm90 import PREP_REGS, _scan_ws_sm90_kernel

    BT = BK = 64                                                            # the kernel's tile sides
    if seg == 0 and sp.cu_seqlens is not None and not LONGEST_FIRST:
        segments = segments[1]                                              # the sequences as given (A/B)
    if seg:
        lanes = programs * p.HV                                             # segments of (about) one length
    else:
        lanes = whole_lanes(p, triton_chunk._chunk_counts(p))
    gk = sp.kd is not None
    if gk and SCAN_STAGES != 2:
        raise ValueError(f"SCAN_STAGES = {SCAN_STAGES}: KDA's scans run two stages (a third needs more than the "
                         "227 KB of shared memory at 64 columns)")
    if chains is None:                                                      # (a pipeline's pieces: one)
        chains = regs_chains(p, seg, sp.h_chunks is not None, lanes, sm_count(p.device))
    if sp.gates:                                                            # (the gater's warpgroup: one)
        chains = 1
    if chains:
        return _regs_scan(p, sp, seg, segments, seg_state, programs, chains)
    if sp.beta_in_p:
        raise RuntimeError("P diag(beta) is read by the state-in-registers scan only")
    h_chunks = None if seg == 1 else sp.h_chunks                            # (a summary stores no chunk states)
    cols = p.V + p.K if seg == 1 else p.V                                   # a summary's V + K columns
    table = GK_WIDTHS if gk else STEP_US
    if seg == 1:                                                            # on the two-chain scan only
        table = {bv: step for bv, step in table.items() if bv in DUAL_WIDTHS[gk]}
    BV, warpgroups = scan_tile(lanes, cols, sm_count(p.device), table)
    if SCAN_BLOCK_V:                                                        # sweep overrides
        widths = GK_WIDTHS if gk else WARPGROUPS
        if SCAN_BLOCK_V not in widths or p.V % SCAN_BLOCK_V:
            raise ValueError(f"SCAN_BLOCK_V = {SCAN_BLOCK_V}: one of {list(widths)} dividing V = {p.V}")
        BV, warpgroups = SCAN_BLOCK_V, WARPGROUPS[SCAN_BLOCK_V]
    warpgroups = SCAN_WARPGROUPS or warpgroups
    if h_chunks is not None:
        BV, warpgroups = 32, 1          # storing the chunk states spills at 64 columns (448 B, sm_90 compile)
    rows = p.B * p.T
    specialized = SCAN_SPECIALIZED and BV in SPECIALIZED_WIDTHS and warpgroups == 1 and not gk and p.delta
    dual = SCAN_DUAL and BV in DUAL_WIDTHS[gk] and h_chunks is None and not specialized
    if seg == 1 and not (dual and p.V % (BV // 2) == 0 and cols % BV == 0):
        raise RuntimeError(f"the segment summary runs on the two-chain scan only (BV = {BV}, V = {p.V})")
    box_v = BV // 2 if dual else BV                                         # the dual chains' value tiles
    tile, vtile = _tile_layout(BT, BK), _tile_layout(BT, box_v)

    def desc(x, width, block, layout):
        return tma_descriptor(x, rows, width, block, layout)

    SK, SV = (1, p.K) if p.state_v_first else (p.V, 1)
    if dual:
        kernel, launch = _scan_dual_sm90_kernel, dict(STAGES=SCAN_STAGES, CHAIN_NREG=CHAIN_REGS,
                                                      LOADER_NREG=LOADER_REGS, num_warps=4)
        if SCAN_MAXNREG:
            launch.update(maxnreg=SCAN_MAXNREG)
    elif specialized:
        kernel, launch = _scan_ws_sm90_kernel, dict(PREP_NREG=PREP_REGS, num_warps=4)
    else:
        kernel, launch = _scan_sm90_kernel, dict(STAGES=SCAN_STAGES, WARPGROUPS=warpgroups, num_warps=4 * warpgroups)
    # GK (KDA): the gated keys and queries are per value head, and the kd tiles and chunk decays
    # come too (the one- and two-chain kernels; the warp-specialized one serves GDN only)
    # The plain rule (DELTA False) reads no P nor, with GK, gated keys: kd's descriptor stands in
    # for the keys' (its P and beta are the scores, triton_chunk.run)
    qk_width = (p.HV if gk else p.H) * p.K
    kd = desc(sp.kd, qk_width, [BT, BK], tile) if gk else None
    args = [kd if gk and not p.delta else desc(sp.k, qk_width, [BT, BK], tile), desc(sp.q, qk_width, [BT, BK], tile)]
    takes_kd = kernel is not _scan_ws_sm90_kernel
    if takes_kd:
        args.append(kd if gk else args[0])
        launch.update(GK=gk, DELTA=p.delta)
    args += [desc(sp.v, p.HV * p.V, [BT, box_v], vtile), desc(sp.inverse, p.HV * BT, [BT, BT], tile),
             desc(sp.scores, p.HV * BT, [BT, BT], tile), desc(sp.o, p.HV * p.V, [BT, box_v], vtile),
             sp.beta, sp.rq, sp.rk, *_or_dummy(sp, sp.gcum)]
    if takes_kd:
        args += _or_dummy(sp, sp.decay if gk else None)
    launcher(kernel, sp.T, sp.NT)[(programs * p.HV * (cols // BV),)](
        *args, sp.o,
        *_or_dummy(sp, sp.h0, sp.ht, h_chunks, sp.cu_seqlens, sp.chunk_start),
        segments, seg_state, sp.T, sp.NT, rows, p.scale,
        H=p.H, HV=p.HV, K=p.K, V=p.V, BV=BV, SK=SK, SV=SV, HAS_H0=sp.h0 is not None, STORE_FINAL=sp.ht is not None,
        L2NORM=p.use_qk_l2norm and not gk, VARLEN=sp.cu_seqlens is not None, SEG=seg, BETA=sp.beta_mode,
        STORE_STATES=h_chunks is not None, **launch,
    )


def _regs_scan(p: Problem, sp: triton_chunk.SequencePass, seg: int, segments, seg_state, programs: int, chains: int):
    """The sequence pass on the state-in-registers scan (chunk_delta_regs_sm90.py): 64 value
    columns a chain, ``chains`` a program, the [64, 64] tiles of the other scans."""
    from fastla.backends.gluon.chunk_delta_regs_sm90 import (
        BV_REGS, CHAIN_REGS, CHAIN_REGS_QK, LOADER_REGS, _scan_regs_sm90_kernel,
    )

    BT = BK = BV_REGS.value
    BV = BT * chains
    rows = p.B * p.T
    tile = _tile_layout(BT, BK)

    def desc(x, width):
        return tma_descriptor(x, rows, width, [BT, BK], tile)

    SK, SV = (1, p.K) if p.state_v_first else (p.V, 1)
    gk = sp.kd is not None                              # KDA: gated keys and queries per value head, kd
    qk = sp.scores is None                              # the scores formed in the chains (scores_in_scan)
    if qk and gk:
        raise RuntimeError("the scores are formed in the scan only for GDN")
    if sp.gates and (chains != 1 or seg):
        raise RuntimeError("the gater serves one chain a program on whole sequences")
    qk_width = (p.HV if gk and not sp.gates else p.H) * p.K  # (the gater reads the raw q and k)
    k = desc(sp.k, qk_width)
    launcher(_scan_regs_sm90_kernel, sp.T, sp.NT)[(programs * p.HV * (p.V // BV),)](
        k, desc(sp.q, qk_width), desc(sp.kd, p.HV * p.K) if gk else k, desc(sp.v, p.HV * p.V),
        desc(sp.inverse, p.HV * BT), k if qk else desc(sp.scores, p.HV * BT), desc(sp.o, p.HV * p.V),
        sp.beta, sp.rq, sp.rk, *_or_dummy(sp, sp.gcum, sp.decay if gk else None), sp.o,
        *_or_dummy(sp, sp.h0, sp.ht, sp.cu_seqlens, sp.chunk_start),
        segments, seg_state, *_or_dummy(sp, p.A_log if sp.gates else None, p.dt_bias if sp.gates else None),
        sp.T, sp.NT, rows, p.scale, float(p.lower_bound or 0.0) if sp.gates else 0.0,
        H=p.H, HV=p.HV, K=p.K, V=p.V, SK=SK, SV=SV, HAS_H0=sp.h0 is not None, STORE_FINAL=sp.ht is not None,
        L2NORM=p.use_qk_l2norm and (sp.gates or not gk), VARLEN=sp.cu_seqlens is not None, SEG=seg,
        BETA=sp.beta_mode, STAGES=SCAN_STAGES, GK=gk, CHAINS=chains,
        CHAIN_NREG=CHAIN_REGS_QK if qk else CHAIN_REGS, LOADER_NREG=LOADER_REGS, QK=qk, GATES=sp.gates,
        HAS_A=sp.gates and p.A_log is not None, HAS_BIAS=sp.gates and p.dt_bias is not None,
        PACKED=sp.gates and GATER_PACKED, WHOLE=WHOLE_CHUNK_BRANCHES, BETA_IN_P=sp.beta_in_p, num_warps=4,
    )


def run(p: Problem):
    from fastla.backends.gluon import chunk_prepare_kda_sm90 as kda_prologue
    from fastla.backends.gluon import chunk_inverse_sm90 as gdn_inverse
    from fastla.backends.gluon import chunk_scores_sm90 as gdn_scores

    p = triton_chunk.dense_inputs(p, align=16, in_place=in_place_views(p))   # (TMA: 16-byte aligned bases)
    config = plan(p)
    kernels = {}
    if p.gk is not None and KDA_PROLOGUE_SM90:     # KDA and GLA (GLA: no A, kg nor P; supports: bf16 inputs)
        why = kda_prologue.serves(p)
        if why is None:
            kernels["kda_prologue"] = kda_prologue.launch
        else:
            _log_once(f"KDA prologue on the Triton kernels: {why}")
    elif p.gk is None:              # (supports: K = 64 or 128, whole [64, 64] TMA boxes of keys)
        if GDN_SCORES_SM90:
            kernels["gdn_scores"] = gdn_scores.launch
        if GDN_INVERSE_SM90 and p.delta:           # (the plain rule's G: the Triton gate cumsum)
            kernels["gdn_inverse"] = gdn_inverse.launch
    pieces = pipeline_pieces(p, config) if len(kernels) == 2 else 1
    in_scan = len(kernels) == 2 and scores_in_scan(p, config, pieces)
    if pieces > 1:
        return _run_pipelined(p, config, pieces)
    if in_scan:
        kernels.pop("gdn_scores")
    gates = "kda_prologue" in kernels and gates_in_scan(p, config)
    beta_in_p = BETA_IN_P and (in_scan or gates)
    return triton_chunk.run(p, config, sequence_scan=_sequence_scan, summaries=summaries_sm90(p), dense=False,
                            scores_in_scan=in_scan, gates_in_scan=gates, beta_in_p=beta_in_p, **kernels)


def scores_in_scan(p: Problem, config: triton_chunk.ChunkConfig, pieces: int) -> bool:
    """Whether GDN's scores are formed in the scan (SCORES_IN_SCAN): every sequence pass of the
    call on the state-in-registers scan (whole sequences with no segments planned where
    ``regs_chains`` gives one or two chains), no chunk states, not pipelined (the pieces' scores
    kernel runs beside the scan, on idle SMs: h16-hv32/1x8192 240.7 -> 277.5 us with the scores in
    the scan, gdn_prefill_sweep-v32-scores-in-scan.json), a positive scale (it rides in the scores'
    exponent as log2(scale rq): _form_scores)."""
    if not (SCORES_IN_SCAN and p.delta and p.gk is None and not p.return_intermediate_states) or pieces > 1:
        return False
    if not p.scale > 0:
        return False
    counts = triton_chunk._chunk_counts(p)
    if triton_chunk._segments(p, config, counts):
        return False
    return regs_chains(p, 0, False, whole_lanes(p, counts), sm_count(p.device)) > 0


def gates_in_scan(p: Problem, config: triton_chunk.ChunkConfig) -> bool:
    """Whether KDA's gated keys and queries are formed in the scan (GATES_IN_SCAN): the bounded
    gate in the op on the sm_90 prologue, bf16 q, k and gate, K and V multiples of 64, no chunk
    states, and the whole call one pass of the state-in-registers scan on one chain a program (no
    segments planned; the gaters' registers leave no room for a second chain). Where the plan takes
    two chains, one with the gaters only if its programs fill their last wave to GATES_WAVE_FILL:
    a part-empty wave lost more than the prologue saved on an H100 (docs/notes/kda-prefill.md
    v22-v23)."""
    from fastla.backends.gluon import chunk_prepare_kda_sm90 as kda_prologue
    from fastla.backends.triton.chunk_prepare_kda import bounded_spans

    if not (GATES_IN_SCAN and KDA_PROLOGUE_SM90 and p.delta and p.gk is not None and bounded_spans(p)):
        return False
    if p.return_intermediate_states or p.K % 64 or p.V % 64 or kda_prologue.serves(p) is not None:
        return False
    if any(x.dtype != torch.bfloat16 for x in (p.q, p.k, p.gk)):
        return False
    counts = triton_chunk._chunk_counts(p)
    if triton_chunk._segments(p, config, counts):
        return False
    lanes, sms = whole_lanes(p, counts), sm_count(p.device)
    chains = regs_chains(p, 0, False, lanes, sms)
    if chains != 2 or REGS_CHAINS:                                          # (two forced: two chains)
        return chains == 1
    programs = lanes * p.V / 64                                             # the one-chain scan's
    return programs / (math.ceil(programs / sms) * sms) >= GATES_WAVE_FILL


def pipeline_pieces(p: Problem, config: triton_chunk.ChunkConfig) -> int:
    """Pieces of GDN's pipeline (PIPELINE, ``_run_pipelined``) for ``p``, 1 for none: one
    sequence (offsets, if any, ``[0, T]`` on the host) on the one-chain state-in-registers scan whose programs (HV x V / 64) take at most
    half the SMs, with no segments planned (their summaries run their own prologue-free pass), a
    gate and beta given (their stand-ins would be filled on the caller's stream), no chunk states;
    PIECES pieces of at least PIECE_CHUNKS chunks (PIPELINE_PIECES: forced where it serves); tensors
    on the current device."""
    if not (PIPELINE and SCAN_REGS and p.delta and p.gk is None and p.g is not None and p.beta is not None):
        return 1
    if p.B != 1 or not triton_chunk.one_sequence(p) or p.return_intermediate_states or p.pool is not None or p.V % 64:
        return 1
    if p.device.type == "cuda" and p.device.index not in (None, torch.cuda.current_device()):
        return 1                    # (the launches and the stream steps take the current device's streams)
    chunks = triton_chunk.cdiv(p.T, triton_chunk.BT)
    if triton_chunk._segments(p, config, (chunks,)) or p.HV * p.V // 64 > sm_count(p.device) // 2:
        return 1
    pieces = PIPELINE_PIECES or min(PIECES, chunks // PIECE_CHUNKS)
    return max(1, min(pieces, chunks))


_SIDE_STREAMS: dict = {}         # (device, the caller's stream) -> its side stream


def _run_pipelined(p: Problem, config: triton_chunk.ChunkConfig, pieces: int):
    """GDN's forward as ``pieces`` pieces (triton_chunk.run_in_pieces): each piece's inverse and
    scores kernels on a side stream (one per device and caller's stream, so that concurrent
    callers and graph captures on other streams never share it; forked from the caller's stream at
    the start of the call and joined at its end, also when the call raises), its one-chain scan on
    the caller's stream after an event the piece's scores record. The tensors the side stream
    touches are held until the join (after it, the allocator's reuse of their memory is ordered
    after the side stream's work). Outputs equal an unpipelined call on the one-chain scan
    (REGS_CHAINS 1) bit for bit: the same kernels and state; the plan's unpipelined call at these
    lane counts runs the two-chain scan, which measured bit-equal too (v26, v27 sweeps). The
    stream steps go through call_plan (fork, record_event, wait_event, join), so a plan replays
    them."""
    from fastla.backends.gluon import chunk_inverse_sm90 as gdn_inverse
    from fastla.backends.gluon import chunk_scores_sm90 as gdn_scores
    from fastla.core import call_plan

    side = None
    if p.device.type == "cuda":
        key = (p.device, torch.cuda.current_stream(p.device).cuda_stream)
        side = _SIDE_STREAMS.get(key)
        if side is None:
            side = _SIDE_STREAMS[key] = torch.cuda.Stream(p.device)
    held = []

    def on_side(launch, ready=None):
        def run_side(*args):
            held.append(args)
            if side is None:                                # (the CPU host stub: one stream)
                return launch(*args)
            with torch.cuda.stream(side):
                launch(*args)
            if ready is not None:
                call_plan.record_event(ready, side)
        return run_side

    def run_piece(sub, out):
        ready = torch.cuda.Event() if side is not None else None

        def scan(*args):
            if ready is not None:
                call_plan.wait_event(ready, side)
            return _sequence_scan(*args, chains=1)

        return triton_chunk.run(sub, config, sequence_scan=scan, dense=False, out=out,
                                gdn_inverse=on_side(gdn_inverse.launch), gdn_scores=on_side(gdn_scores.launch, ready))

    if side is not None:
        call_plan.fork(side)
    try:
        return triton_chunk.run_in_pieces(p, triton_chunk.piece_cuts(p.T, pieces), run_piece)
    finally:
        if side is not None:
            call_plan.join(side)
        held.clear()


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logging.getLogger("fastla").info(message)
