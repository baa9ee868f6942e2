"""The Gluon tier's decode: one token per sequence on the sm_90 streaming kernel (recurrent_sm90.py),
where the state's traffic bounds the step; everything else is the Triton kernel's
(backends/triton/recurrent.py), which this tier's ``supports`` hands over with the reason."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fastla.backends.gluon import available
from fastla.backends.gluon.chunk_delta import tma_descriptor
from fastla.backends.triton import recurrent as triton_recurrent
from fastla.backends.triton import sm_count
from fastla.backends.triton.launch import launcher
from fastla.core import call_plan
from fastla.core.problem import Problem

# Sweep overrides (None: the plan's choice).
BLOCK_V = None
STAGES = None
PROGRAMS_PER_SM = None
# Where this kernel serves (benchmarks/decode_stream_sweep.py, docs/notes/decode.md v6, H200, HV 32,
# K = V = 128, pool form): bf16 states of 32 MB or more. Below that (N = 16: 16 MB) the pool stays
# in L2 and the Triton kernel's many small programs win (9.7 vs 12.3 us); fp32 states the Triton
# kernel already moves at 3.9-4.1 TB/s, and this one measured 0-10% slower there (tests and sweeps
# turn SERVE_FP32 on).
MIN_STATE_BYTES = 32 << 20
SERVE_FP32 = False


@dataclass(frozen=True)
class StreamPlan:
    block_v: int
    stages: int
    programs_per_sm: int
    num_warps: int = 4


SHARED_BYTES = 227 * 1024            # one SM's shared memory for a block (H100 / H200)


def shared_bytes(p: Problem, plan: StreamPlan) -> int:
    """A program's shared memory: the load stages and two store buffers of [K, BV] state tiles."""
    tile = p.K * plan.block_v * p.initial_state.element_size()
    return (plan.stages + 2) * tile + 1024


def stream_plan(p: Problem) -> StreamPlan:
    """Tile width, tiles in flight per program, programs per SM (the sweep's overrides applied).
    Measured (bf16 pool, N = 64 / 256, HV 32; docs/notes/decode.md v6): 64 columns, 2 stages, 3
    programs an SM, the [K] inputs compact: GDN 41.7 / 152.5 us, KDA 42.9 / 154.4 (KDA's per-key
    gate at 32 columns, 4 programs: 45.7 / 172.6 before the compact inputs made 64 fit in 156
    registers); fp32 64 columns, 3 stages, one program (160 KB)."""
    fp32 = p.initial_state.element_size() == 4
    bv = BLOCK_V or min(64, p.V)
    stages, programs = (3, 1) if fp32 else (2, 3)
    return StreamPlan(bv, STAGES or stages, PROGRAMS_PER_SM or programs, 8 if bv >= 128 else 4)


def check_plan(p: Problem, plan: StreamPlan) -> None:
    if p.V % plan.block_v or plan.block_v < 4 * plan.num_warps:
        raise ValueError(f"block_v = {plan.block_v}: it must divide V = {p.V} and give each of the "
                         f"{plan.num_warps} warps 4 columns or more")
    need = shared_bytes(p, plan)
    if need * plan.programs_per_sm > SHARED_BYTES:
        raise ValueError(f"the plan {plan} needs {need} bytes of shared memory a program, "
                         f"{plan.programs_per_sm} programs an SM: more than {SHARED_BYTES}")


def _single_token(p: Problem) -> str | None:
    if p.cu_seqlens is None and p.cu_seqlens_host is None:
        return None if p.T == 1 else f"T = {p.T} tokens per sequence (the sm_90 decode takes one)"
    host = p.cu_seqlens_host
    if host is None:
        return "cu_seqlens without cu_seqlens_cpu (the sm_90 decode must see one token per sequence on the host)"
    if any(b - a != 1 for a, b in zip(host, host[1:])):
        return "a sequence of more than one token (the sm_90 decode takes one)"
    return None


def supports(p: Problem) -> str | None:
    reason = available(p.device) or triton_recurrent.supports(p)
    if reason:
        return reason
    reason = _single_token(p)
    if reason:
        return reason
    h = p.initial_state
    if h is None:
        return "no initial state (nothing to stream: the Triton kernel serves it)"
    if p.pool is not None and (p.pool.indices.dim() == 2 or p.pool.num_accepted_tokens is not None):
        return "per-token pool indices or num_accepted_tokens (multi-token verify: the Triton kernel)"
    if p.pool is not None and p.pool.disable_state_update or p.pool is None and not p.output_final_state:
        return "no state to write (disable_state_update, or no final state): the sm_90 decode always writes"
    if h.dtype not in (torch.float32, torch.bfloat16):
        return f"a {h.dtype} state (the sm_90 decode streams fp32 or bf16)"
    if p.pool is None and h.dtype != torch.float32:
        return "a bf16 initial_state outside a pool (the final state is fp32: the Triton kernel converts)"
    if h.dtype == torch.float32 and not SERVE_FP32:
        return "an fp32 state (the Triton kernel is as fast or faster there: 3.9-4.1 TB/s, measured)"
    if p.K not in (64, 128) or p.V not in (64, 128):
        return f"K = {p.K}, V = {p.V} (the sm_90 decode takes 64 or 128)"
    if h.data_ptr() % 16:
        return "the state is not 16-byte aligned (TMA)"
    if h.shape[0] * p.HV * max(p.K, p.V) >= 2 ** 31:
        return "the state has 2^31 rows or more (the TMA coordinates are int32)"
    if p.N * p.HV * p.K * p.V * h.element_size() < MIN_STATE_BYTES:
        return f"less than {MIN_STATE_BYTES >> 20} MB of state (the Triton kernel is faster there)"
    return None


@functools.lru_cache(maxsize=None)
def _state_tile_layout(bits: int):
    """The unswizzled shared layout of a state tile (its rows read whole by the register layout)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(0, bits, 2)


def _seq_strides(x: torch.Tensor | None, dense: bool) -> tuple[int, int]:
    """(sequence, head) element strides of a one-token-per-sequence input: [N, 1, H, ..] or [1, N, H, ..]."""
    if x is None:
        return 0, 0
    return (x.stride(0) if dense else x.stride(1)), x.stride(2)


def run(p: Problem, plan: StreamPlan | None = None):
    from fastla.backends.gluon.recurrent_sm90 import _decode_sm90_kernel

    plan = plan or stream_plan(p)
    check_plan(p, plan)
    N, HV, K, V = p.N, p.HV, p.K, p.V
    BV = plan.block_v
    h0 = p.initial_state
    o = call_plan.empty(p.v.shape, p.o_dtype, p.device)
    if p.pool is not None:
        ht, slots = h0, p.pool.indices
    else:
        shape = (N, HV, V, K) if p.state_v_first else (N, HV, K, V)
        ht, slots = call_plan.empty(shape, torch.float32, p.device), None
    layout = _state_tile_layout(8 * h0.element_size())
    rows_per_head, width, box = (V, K, [BV, K]) if p.state_v_first else (K, V, [K, BV])

    def view(x):
        return tma_descriptor(x, x.shape[0] * HV * rows_per_head, width, box, layout)

    n_rows = ht.shape[0] * HV * rows_per_head
    gate = triton_recurrent.gate_mode(p)
    n_tiles = N * HV * (V // BV)
    grid = (min(n_tiles, plan.programs_per_sm * sm_count(p.device)),)
    dense = p.cu_seqlens is None and p.cu_seqlens_host is None
    d = o
    launcher(_decode_sm90_kernel)[grid](
        view(h0), view(ht), p.q, p.k, p.v, p.g if p.g is not None else d, p.gk if p.gk is not None else d,
        p.beta if p.beta is not None else d, p.A_log if p.A_log is not None else d,
        p.dt_bias if p.dt_bias is not None else d, p.g_gamma if p.g_gamma is not None else d,
        o, slots if slots is not None else d,
        p.scale, float(p.lower_bound) if p.lower_bound is not None else 0.0, n_tiles, n_rows,
        slots.stride(0) if slots is not None else 0,
        *_seq_strides(p.q, dense), *_seq_strides(p.k, dense), *_seq_strides(p.v, dense),
        *_seq_strides(p.g, dense), *_seq_strides(p.gk, dense), *_seq_strides(p.beta, dense),
        H=p.H, HV=HV, K=K, V=V, BV=BV, V_FIRST=p.state_v_first, DELTA=p.delta,
        HAS_G=p.g is not None, HAS_GK=p.gk is not None, HAS_GAMMA=p.g_gamma is not None, GATE=gate,
        HAS_A=p.A_log is not None, HAS_BIAS=p.dt_bias is not None, L2NORM=p.use_qk_l2norm,
        BETA=triton_recurrent.beta_mode(p), POOL=slots is not None,
        STAGES=plan.stages, num_warps=plan.num_warps,
    )
    if p.pool is not None:
        return o, h0
    return o, ht
