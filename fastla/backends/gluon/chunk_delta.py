"""The Gluon tier's GDN chunked forward: the Triton prologue, segment summaries and combine
(backends/triton/chunk_delta.py), with the sequence passes of the scan in the sm_90 kernel
(chunk_delta_sm90.py)."""
from __future__ import annotations

import torch

from fastla.backends.gluon import available
from fastla.backends.triton import chunk_delta as triton_chunk
from fastla.core.problem import Problem

SCAN_BLOCK_V = 32           # value columns per program
SCAN_STAGES = 2             # chunks of tiles in flight


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
    if p.V % SCAN_BLOCK_V:
        return f"V = {p.V} (the sm_90 scan takes multiples of {SCAN_BLOCK_V})"
    if any(x.data_ptr() % 16 for x in (p.q, p.k, p.v)):
        return "q, k or v is not 16-byte aligned (TMA)"
    return None


def _sequence_scan(p: Problem, sp: triton_chunk.SequencePass, seg: int, segments, seg_state, programs: int):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fastla.backends.gluon.chunk_delta_sm90 import _scan_sm90_kernel

    BT = BK = 64                                                            # the kernel's tile sides
    BV = SCAN_BLOCK_V
    rows = p.B * p.T
    tile = gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16)
    vtile = gl.NVMMASharedLayout.get_default_for([BT, BV], gl.bfloat16)

    def desc(x, width, block, layout):
        return TensorDescriptor.from_tensor(x.view(rows, width), block, layout)

    SK, SV = (1, p.K) if p.state_v_first else (p.V, 1)
    d = sp.dummy
    _scan_sm90_kernel[(programs * p.HV, p.V // BV)](
        desc(sp.k, p.H * p.K, [BT, BK], tile), desc(sp.q, p.H * p.K, [BT, BK], tile),
        desc(sp.v, p.HV * p.V, [BT, BV], vtile), desc(sp.inverse, p.HV * BT, [BT, BT], tile),
        desc(sp.scores, p.HV * BT, [BT, BT], tile),
        sp.beta, sp.rq, sp.rk, sp.gcum, sp.o,
        sp.h0 if sp.h0 is not None else d, sp.ht if sp.ht is not None else d,
        sp.h_chunks if sp.h_chunks is not None else d,
        sp.cu_seqlens if sp.cu_seqlens is not None else d, sp.chunk_start if sp.chunk_start is not None else d,
        segments, seg_state, sp.T, sp.NT, p.scale,
        H=p.H, HV=p.HV, K=p.K, V=p.V, BV=BV, SK=SK, SV=SV, HAS_H0=sp.h0 is not None, STORE_FINAL=sp.ht is not None,
        L2NORM=p.use_qk_l2norm, VARLEN=sp.cu_seqlens is not None, SEG=seg, BETA=sp.beta_mode,
        STORE_STATES=sp.h_chunks is not None, STAGES=SCAN_STAGES, num_warps=4,
    )


def run(p: Problem):
    config = triton_chunk.default_config(p)
    return triton_chunk.run(p, config, sequence_scan=_sequence_scan)
