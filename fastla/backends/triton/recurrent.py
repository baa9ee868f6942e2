"""Triton decode kernel: one token-by-token recurrence for every variant, on the state in place.

Serves ``fused_recurrent_{gated_delta_rule,kda,gla,simple_gla,lightning_attn}`` forward
calls (no autograd: a call that needs gradients goes to the torch tier).

Shapes (any batch/time/head strides; the last dim must be contiguous, else the torch tier serves):
    q, k      [B, T, H, K]          v, o   [B, T, HV, V]        (o in v's dtype)
    g         [B, T, HV]            scalar log decay, or the raw GDN gate input
    gk        [B, T, HV, K]         per-key log decay, or the raw KDA gate input
    beta      [B, T, HV]            (logits with the beta sigmoid in the op)
    state     [slots or N, HV, K, V] (V-first: [.., HV, V, K]), fp32 or bf16 storage, fp32 math

Grid: ``(N * HV * cdiv(V, BV),)``, one axis (2^31 - 1 programs), a head's V tiles adjacent: they
share the state's rows, so programs that run together read whole rows (with the tiles on a
second grid axis, launched after every head's first tile, bf16 N=256 took 274 us at BV 32
against 176-187 us adjacent; docs/notes/decode.md). One program owns the ``[K, BV]`` slab of one
value head's
state for one sequence: it loads it once (from ``initial_state`` or pool slot
``ssm_state_indices``), runs the sequence's tokens (gate, l2norm, beta, delta rule, output),
and stores it once (per token for 2-D indices). Budget per program: ``BK * BV`` fp32 state
registers (K = 128, BV = 32: 32 per thread at 4 warps). Traffic per decode step and head:
the state read and written once (2 x K x V x 4 B in fp32), q/k/v/o, gates.

Tiles (:func:`default_config`, measured): ``BV`` 64 with 2 warps when the grid is large,
32 with 1 warp in between, 16 with 1 warp for few sequences, which spreads one state over
more CTAs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastla.backends.triton import cdiv, next_pow2, sm_count
from fastla.backends.triton.activations import (
    BETA_GIVEN, BETA_ONE, BETA_SIGMOID, BETA_SIGMOID2, GATE_GDN, GATE_KDA, GATE_KDA_BOUNDED, GATE_NONE,
    activate_beta, log_decay,
)
from fastla.backends.triton.launch import launcher
from fastla.core import call_plan
from fastla.core.problem import Problem

# Pool addressing.
POOL_NONE, POOL_PER_SEQ, POOL_PER_TOKEN = 0, 1, 2


@triton.jit
def token_decay(b_a, b_g, b_gk, b_A, b_bias, b_bias_k, b_gamma, lower_bound, HAS_G: tl.constexpr,
                HAS_GK: tl.constexpr, HAS_GAMMA: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One token's decay of each key row of the state, ``a = exp(g) * exp(gk)`` [BK], from ``b_a``
    (ones [BK]), the raw scalar gate ``b_g`` and the raw per-key gate ``b_gk`` [BK] (each transformed
    here when the gate is in the op: activations.py). Shared by the Triton and the
    sm_90 decode kernels (backends/gluon/recurrent_sm90.py); unused arguments may be any scalar."""
    if HAS_G:
        if GATE == 1:
            if HAS_BIAS:
                b_g = b_g + b_bias
            b_g = log_decay(b_g, b_A, 0.0, False)
        if HAS_GAMMA:
            b_g = b_g + b_gamma
        b_a = b_a * tl.exp(b_g)
    elif HAS_GAMMA:
        b_a = b_a * tl.exp(b_gamma)
    if HAS_GK:
        if GATE >= 2:
            if HAS_BIAS:
                b_gk = b_gk + b_bias_k
            b_gk = log_decay(b_gk, b_A, lower_bound, GATE == 3)
        b_a = b_a * tl.exp(b_gk)
    return b_a


@triton.jit
def token_update(b_h, b_a, b_q, b_k, b_v, b_beta, scale, DELTA: tl.constexpr, BETA: tl.constexpr,
                 L2NORM: tl.constexpr):
    """One token of the recurrence on the fp32 state tile ``b_h`` [BK, BV]: the decay ``b_a`` [BK],
    q, k [BK], v [BV] in fp32, the raw beta (activated here by ``BETA``). Returns the output
    [BV] and the new tile. Both reductions read the tile as loaded: with S' = Diag(a) S,
    S'^T k = S^T (a*k) and o = (S' + k u^T)^T q = S^T (a*q) + (q.k) u, so the two cross-thread
    sums are independent and the update is one FMA per element. The l2norm enters as two scalars
    applied after the state products, so its reductions run alongside them (the step's dependent
    chain is its latency)."""
    r_q = 1.0
    r_k = 1.0
    if L2NORM:
        r_q = 1.0 / tl.sqrt(tl.sum(b_q * b_q, 0) + 1e-6)
        r_k = 1.0 / tl.sqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_hk = tl.sum(b_h * (b_a * b_k)[:, None], 0) * r_k                       # [BV]
    b_hq = tl.sum(b_h * (b_a * b_q)[:, None], 0) * r_q                       # [BV]
    if DELTA:
        if BETA >= 2:
            b_beta = activate_beta(b_beta, BETA)
        b_u = b_beta * (b_v - b_hk)                                           # [BV]
    else:
        b_u = b_v
    b_o = (b_hq + tl.sum(b_q * b_k, 0) * (r_q * r_k) * b_u) * scale          # [BV]
    b_h = b_h * b_a[:, None] + (b_k * r_k)[:, None] * b_u[None, :]
    return b_o, b_h


@triton.jit
def _recurrent_fwd_kernel(
    q, k, v, g, gk, beta, A_log, dt_bias, g_gamma,
    o, h0, ht,
    cu_seqlens, slots, accepted,
    scale, lower_bound,
    T, stride_slots, stride_slots_t,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,      # element strides (batch, time, head)
    sg_b, sg_t, sg_h, sgk_b, sgk_t, sgk_h, sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    SK: tl.constexpr, SV: tl.constexpr,                    # state strides inside one head
    DELTA: tl.constexpr, HAS_G: tl.constexpr, HAS_GK: tl.constexpr, HAS_GAMMA: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
    L2NORM: tl.constexpr, BETA: tl.constexpr,
    VARLEN: tl.constexpr, POOL: tl.constexpr, ACCEPTED: tl.constexpr,
    HAS_H0: tl.constexpr, WRITE: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    i_p = tl.program_id(0).to(tl.int64)                                     # up to 2^31 - 1 programs
    i_nh = i_p // NV                                                        # a head's NV tiles adjacent
    i_v = i_p % NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        row = 0                                                          # packed: batch row 0
    else:
        bos = i_n * T
        eos = bos + T
        row = i_n
    # the sequence's first token in each input, then one time stride per token
    first_t = bos - row * T
    p_q = q + row * sq_b + first_t * sq_t + i_h * sq_h
    p_k = k + row * sk_b + first_t * sk_t + i_h * sk_h
    p_v = v + row * sv_b + first_t * sv_t + i_hv * sv_h
    p_g = g + row * sg_b + first_t * sg_t + i_hv * sg_h
    p_gk = gk + row * sgk_b + first_t * sgk_t + i_hv * sgk_h
    p_beta = beta + row * sb_b + first_t * sb_t + i_hv * sb_h

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    # masks only where the tile overhangs (a constant mask keeps the state loads vectorised)
    if K == BK:
        m_k = tl.full([BK], 1, tl.int1)
    else:
        m_k = o_k < K
    if V % BV == 0:
        m_v = tl.full([BV], 1, tl.int1)
    else:
        m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    head = i_hv * K * V
    p_tile = o_k[:, None] * SK + o_v[None, :] * SV                      # [BK, BV] offsets in a head

    # start state: the pool slot (negative: the row is skipped) or the sequence's initial state
    live = True
    if POOL == 1:
        slot = tl.load(slots + i_n * stride_slots).to(tl.int64)
        live = slot >= 0
        src = h0 + tl.maximum(slot, 0) * (HV * K * V)
    elif POOL == 2:
        col = 0
        if ACCEPTED:
            col = tl.load(accepted + i_n).to(tl.int64) - 1
        slot = tl.load(slots + i_n * stride_slots + col * stride_slots_t).to(tl.int64)
        live = slot >= 0
        src = h0 + tl.maximum(slot, 0) * (HV * K * V)
    else:
        src = h0 + i_n * (HV * K * V)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)                           # [BK, BV]
    if HAS_H0:
        b_h = tl.load(src + head + p_tile, mask=m_h & live, other=0.0).to(tl.float32)

    b_A = 1.0
    b_gamma = 0.0
    b_bias = 0.0
    b_bias_k = 0.0
    if HAS_A:
        b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    if HAS_GAMMA:
        b_gamma = tl.load(g_gamma + i_hv).to(tl.float32)
    if HAS_BIAS:
        if GATE == 1:
            b_bias = tl.load(dt_bias + i_hv).to(tl.float32)
        else:
            b_bias_k = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)   # [BK]

    for i_rel in range(0, eos - bos):
        i_t = bos + i_rel
        b_q = tl.load(p_q + i_rel * sq_t + o_k, mask=m_k, other=0.0).to(tl.float32)        # [BK]
        b_k = tl.load(p_k + i_rel * sk_t + o_k, mask=m_k, other=0.0).to(tl.float32)        # [BK]
        b_v = tl.load(p_v + i_rel * sv_t + o_v, mask=m_v, other=0.0).to(tl.float32)        # [BV]
        b_beta = 1.0
        if DELTA and BETA != 0:
            b_beta = tl.load(p_beta + i_rel * sb_t).to(tl.float32)
        b_g = 0.0
        if HAS_G:
            b_g = tl.load(p_g + i_rel * sg_t).to(tl.float32)
        b_gk = b_q
        if HAS_GK:
            b_gk = tl.load(p_gk + i_rel * sgk_t + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_a = token_decay(tl.full([BK], 1.0, tl.float32), b_g, b_gk, b_A, b_bias, b_bias_k, b_gamma, lower_bound,
                          HAS_G, HAS_GK, HAS_GAMMA, GATE, HAS_BIAS)
        b_o, b_h = token_update(b_h, b_a, b_q, b_k, b_v, b_beta, scale, DELTA, BETA, L2NORM)
        if POOL != 0:
            b_o = tl.where(live, b_o, 0.0)
        tl.store(o + (i_t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if POOL == 2:
            if WRITE:
                slot_t = tl.load(slots + i_n * stride_slots + i_rel * stride_slots_t).to(tl.int64)
                dst = ht + tl.maximum(slot_t, 0) * (HV * K * V)
                tl.store(dst + head + p_tile, b_h.to(ht.dtype.element_ty), mask=m_h & live & (slot_t >= 0))

    if WRITE:
        if POOL == 1:
            dst = ht + tl.maximum(slot, 0) * (HV * K * V)
            tl.store(dst + head + p_tile, b_h.to(ht.dtype.element_ty), mask=m_h & live)
        elif POOL == 0:
            tl.store(ht + i_n * (HV * K * V) + head + p_tile, b_h.to(ht.dtype.element_ty), mask=m_h)


@dataclass(frozen=True)
class DecodeConfig:
    """Tile width along V and warps per program."""

    block_v: int
    num_warps: int


def default_config(p: Problem) -> DecodeConfig:
    """Measured on the H200 (benchmarks/decode_sweep.py, docs/notes/decode.md), K = V = 128, HV 32:

    - plenty of work and an fp32 state (>= 8 programs per SM at BV 64): BV 64, 2 warps
      (N=256: 277 us vs 294 us at BV 32 / 4 warps, 3.9 TB/s of state traffic);
    - otherwise, while BV 32 still gives >= 2 programs per SM: BV 32, 1 warp (bf16 state
      N=16: 9.8 us vs 13.4 us at 4 warps), 2 warps for an fp32 state from 12 programs per SM
      (HV 32, FLA's form, N=16: KDA 19.1 us vs 20.5 at one warp, GDN 20.2 vs 20.8; pool form
      13.2 vs 14.1 and 14.1 vs 14.7; at N=4 and 8, 4 and 8 programs per SM, one warp was as
      fast or faster: 4.96 vs 5.11 us GDN N=4, 7.67 vs 8.03 GDN N=8;
      benchmarks/results/decode_sweep-v7-*.json);
    - few sequences: BV 16, 1 warp, spreading one state over more CTAs (N=1: 3.1 us vs 3.5 us
      at BV 8).
    """
    sms = sm_count(p.device)
    fp32_state = p.initial_state is None or p.initial_state.element_size() == 4
    programs = lambda bv: p.N * p.HV * cdiv(p.V, bv)  # noqa: E731
    if fp32_state and p.V >= 64 and programs(64) >= 8 * sms:
        return DecodeConfig(64, 2)
    if p.V >= 32 and programs(32) >= 2 * sms:
        return DecodeConfig(32, 2 if fp32_state and programs(32) >= 12 * sms else 1)
    return DecodeConfig(min(16, next_pow2(p.V)), 1)


def supports(p: Problem) -> str | None:
    from fastla.backends.triton import available

    reason = available(p.device)
    if reason:
        return reason
    if p.q.dtype == torch.float64:
        return "float64 inputs are served by the torch tier (which keeps a float64 state)"
    if p.gv is not None:
        return "a per-value gate (gv) is served by the torch tier"
    if p.reverse:
        return "reverse=True is served by the torch tier"
    if p.needs_grad():
        return "inputs require grad: the Triton recurrent kernel has no backward (the torch tier has autograd)"
    if any(x.dim() == 4 and x.stride(-1) != 1 for x in (p.q, p.k, p.v, p.gk) if x is not None):
        return "an input's last dim is strided (the kernel needs unit stride along the head dim)"
    if p.cu_seqlens is None and p.cu_seqlens_host is not None and torch.cuda.is_current_stream_capturing():
        return "only cu_seqlens_cpu was given: pass cu_seqlens on the device to capture a CUDA graph"
    if p.initial_state is not None and not p.initial_state.is_contiguous():
        return "initial_state is not contiguous"
    small = [p.cu_seqlens, p.A_log, p.dt_bias, p.g_gamma] + ([p.pool.num_accepted_tokens] if p.pool else [])
    if any(x is not None and x.dim() == 1 and x.stride(0) != 1 for x in small):
        return "a strided 1-D parameter (cu_seqlens, A_log, dt_bias, g_gamma or num_accepted_tokens)"
    return None


def _strides(x: torch.Tensor | None) -> tuple[int, int, int]:
    """(batch, time, head) element strides, zeros for an absent input."""
    return x.stride()[:3] if x is not None else (0, 0, 0)


def gate_mode(p: Problem) -> int:
    """The GATE constexpr of the decode kernels (this one and backends/gluon/recurrent_sm90.py)."""
    if p.gate_in_op == "gdn":
        return GATE_GDN
    if p.gate_in_op == "kda":
        return GATE_KDA if p.lower_bound is None else GATE_KDA_BOUNDED
    return GATE_NONE


def beta_mode(p: Problem) -> int:
    """The BETA constexpr of the decode kernels."""
    if not p.delta or p.beta is None:
        return BETA_ONE
    if p.beta_sigmoid:
        return BETA_SIGMOID2 if p.allow_neg_eigval else BETA_SIGMOID
    return BETA_GIVEN


def run(p: Problem, config: DecodeConfig | None = None):
    config = config or default_config(p)
    N, HV, K, V = p.N, p.HV, p.K, p.V
    o = call_plan.empty(p.v.shape, p.o_dtype, p.device)               # contiguous [B, T, HV, V]
    pool = p.pool
    if pool is not None:
        ht = p.initial_state
        write = not pool.disable_state_update
        mode = POOL_PER_SEQ if pool.indices.dim() == 1 else POOL_PER_TOKEN
    else:
        ht = None
        if p.output_final_state:
            shape = (N, HV, V, K) if p.state_v_first else (N, HV, K, V)
            ht = call_plan.empty(shape, torch.float32, p.device)
        write = ht is not None
        mode = POOL_NONE
    gate, beta = gate_mode(p), beta_mode(p)
    BV = config.block_v
    BK = next_pow2(K)
    dummy = o
    slots = pool.indices if pool is not None else None
    cu = p.cu_seqlens
    if cu is None and p.cu_seqlens_host is not None:
        cu = torch.tensor(p.cu_seqlens_host, dtype=torch.int64, device=p.device)
    grid = (N * HV * cdiv(V, BV),)         # one axis (a second is limited to 65535), tiles adjacent
    launcher(_recurrent_fwd_kernel)[grid](
        p.q, p.k, p.v, p.g if p.g is not None else dummy, p.gk if p.gk is not None else dummy,
        p.beta if p.beta is not None else dummy,
        p.A_log if p.A_log is not None else dummy, p.dt_bias if p.dt_bias is not None else dummy,
        p.g_gamma if p.g_gamma is not None else dummy,
        o, p.initial_state if p.initial_state is not None else dummy, ht if ht is not None else dummy,
        cu if cu is not None else dummy,
        slots if slots is not None else dummy,
        pool.num_accepted_tokens if pool is not None and pool.num_accepted_tokens is not None else dummy,
        p.scale, float(p.lower_bound) if p.lower_bound is not None else 0.0,
        p.T, slots.stride(0) if slots is not None else 0,
        slots.stride(1) if slots is not None and slots.dim() == 2 else 0,
        *_strides(p.q), *_strides(p.k), *_strides(p.v),
        *_strides(p.g), *_strides(p.gk), *_strides(p.beta),
        H=p.H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        SK=1 if p.state_v_first else V, SV=K if p.state_v_first else 1,
        DELTA=p.delta, HAS_G=p.g is not None, HAS_GK=p.gk is not None, HAS_GAMMA=p.g_gamma is not None,
        GATE=gate, HAS_A=p.A_log is not None, HAS_BIAS=p.dt_bias is not None,
        L2NORM=p.use_qk_l2norm, BETA=beta,
        VARLEN=cu is not None, POOL=mode,
        ACCEPTED=pool is not None and pool.num_accepted_tokens is not None,
        HAS_H0=p.initial_state is not None, WRITE=write,
        num_warps=config.num_warps,
    )
    if pool is not None:
        return o, p.initial_state
    return o, ht
