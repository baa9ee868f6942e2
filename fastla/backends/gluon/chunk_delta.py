"""The Gluon tier's GDN chunked forward: the Triton prologue, segment summaries and combine
(backends/triton/chunk_delta.py), with the sequence passes of the scan in the sm_90 kernel
(chunk_delta_sm90.py)."""
from __future__ import annotations

import functools

import torch

from fastla.backends.gluon import available
from fastla.backends.triton import chunk_delta as triton_chunk
from fastla.core.problem import Problem

SCAN_BLOCK_V = None         # value columns per program (None: scan_block_v's plan)
SCAN_STAGES = 2             # chunks of tiles in flight
SCAN_WARPGROUPS = 1         # warpgroups splitting a program's columns (2: a sweep variant, not yet timed)


def scan_block_v(counts: tuple[int, ...], HV: int, V: int, sms: int) -> int:
    """32 value columns per program while one wave of them covers the work, else 64.

    Both tile widths run one program per SM (127 KB and 156 KB of shared memory) and a chunk
    step costs about the same at either width, so 64-column tiles halve the steps once 32-column
    lanes exceed the SMs (H200: 1x32k HV64 scan 1.22 ms at 64 vs 2.06 at 32; 4x8k HV32 0.67 vs
    1.15), and lose while they fit (1x32k HV32 1.11 vs 1.03; 1x8k HV16 0.29 vs 0.23). Lanes are
    weighted by sequence length: a varlen batch is as wide as its total chunks over its longest
    sequence (9 sequences of 16k tokens at HV8: 0.25 vs 0.22 ms)."""
    longest = max(counts, default=0)
    if not longest or V % 64:
        return 32
    lanes = HV * (V // 32) * sum(counts) / longest
    return 32 if lanes <= sms else 64


def supports(p: Problem) -> str | None:
    reason = available(p.device)
    if reason:
        return reason
    reason = triton_chunk.supports(p)
    if reason:
        return f"the Triton prologue cannot serve it: {reason}"
    if any(x.dtype != torch.bfloat16 for x in (p.q, p.k, p.v)):
        return "q, k, v are not bfloat16 (the sm_90 scan loads bf16 tiles)"
    if p.K not in (64, 128):
        return f"K = {p.K} (the sm_90 scan takes K = 64 or 128)"
    if p.V % 32:
        return f"V = {p.V} (the sm_90 scan takes multiples of 32)"
    if any(x.data_ptr() % 16 for x in (p.q, p.k, p.v)):
        return "q, k or v is not 16-byte aligned (TMA)"
    return None


@functools.lru_cache(maxsize=None)
def _tile_layout(rows: int, cols: int):
    """The swizzled shared layout of a bf16 TMA tile (cached: ~10 us a call to build)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def _sequence_scan(p: Problem, sp: triton_chunk.SequencePass, seg: int, segments, seg_state, programs: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fastla.backends.gluon.chunk_delta_sm90 import _scan_sm90_kernel

    BT = BK = 64                                                            # the kernel's tile sides
    BV = SCAN_BLOCK_V or scan_block_v(triton_chunk._chunk_counts(p), p.HV, p.V, triton_chunk._sm_count(p.device))
    if sp.h_chunks is not None:
        BV = 32                         # storing the chunk states spills at 64 columns (448 B, sm_90 compile)
    rows = p.B * p.T
    tile, vtile = _tile_layout(BT, BK), _tile_layout(BT, BV)

    def desc(x, width, block, layout):
        # the fields TensorDescriptor.from_tensor sets, without its re-validation (~5 us a
        # descriptor; contiguity, 16-byte alignment and dtypes are checked in supports)
        base = x.view(rows, width)
        d = TensorDescriptor.__new__(TensorDescriptor)
        d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = (
            base, base.shape, base.stride(), block, layout, "zero")
        return d

    SK, SV = (1, p.K) if p.state_v_first else (p.V, 1)
    d = sp.dummy
    _scan_sm90_kernel[(programs * p.HV, p.V // BV)](
        desc(sp.k, p.H * p.K, [BT, BK], tile), desc(sp.q, p.H * p.K, [BT, BK], tile),
        desc(sp.v, p.HV * p.V, [BT, BV], vtile), desc(sp.inverse, p.HV * BT, [BT, BT], tile),
        desc(sp.scores, p.HV * BT, [BT, BT], tile), desc(sp.o, p.HV * p.V, [BT, BV], vtile),
        sp.beta, sp.rq, sp.rk, sp.gcum, sp.o,
        sp.h0 if sp.h0 is not None else d, sp.ht if sp.ht is not None else d,
        sp.h_chunks if sp.h_chunks is not None else d,
        sp.cu_seqlens if sp.cu_seqlens is not None else d, sp.chunk_start if sp.chunk_start is not None else d,
        segments, seg_state, sp.T, sp.NT, rows, p.scale,
        H=p.H, HV=p.HV, K=p.K, V=p.V, BV=BV, SK=SK, SV=SV, HAS_H0=sp.h0 is not None, STORE_FINAL=sp.ht is not None,
        L2NORM=p.use_qk_l2norm, VARLEN=sp.cu_seqlens is not None, SEG=seg, BETA=sp.beta_mode,
        STORE_STATES=sp.h_chunks is not None, STAGES=SCAN_STAGES,
        WARPGROUPS=SCAN_WARPGROUPS, num_warps=4 * SCAN_WARPGROUPS,
    )


def run(p: Problem):
    config = triton_chunk.default_config(p)
    return triton_chunk.run(p, config, sequence_scan=_sequence_scan)
