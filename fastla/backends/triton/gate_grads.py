"""The training path's KDA gate computed in the op, in Triton (chunk_training.py): the log decay
from the raw gate and its gradients, one pass each, as an autograd Function (``kda_gate``).

The gate (fastla.core.gates.kda_gate has the definitions), for value head h and channel c, with
x = g_raw + dt_bias[h, c] (dt_bias optional) and a = e^(A_log[h]):
    softplus (no lower_bound):  gk = -a softplus(x),          dgk/dx = -a sigmoid(x),   dgk/dA_log = gk
    bounded, A_log given:       gk = lb sigmoid(a x) = lb s,  dgk/dx = lb s (1 - s) a,  dgk/dA_log = x dgk/dx
    bounded, no A_log:          gk = lb sigmoid(x),           dgk/dx = lb s (1 - s)
so that d g_raw = dgk dgk/dx, d dt_bias[h, c] = sum over tokens of d g_raw, d A_log[h] = sum over
tokens and channels of dgk dgk/dA_log (softplus: dgk gk).

- ``_gate_kernel``, grid ``(cdiv(B * T, BLOCK_T), HV)``: g_raw ``[B, T, HV, K]`` (contiguous, any
  float dtype) to gk float32, the same shape.
- ``_gate_grads_kernel``, same grid: from dgk (float32) and g_raw, d g_raw in g_raw's dtype and
  each program's partial sums of d dt_bias ``[programs, HV, K]`` and d A_log ``[programs, HV]``
  (float32), summed over the programs by PyTorch.
Both replace PyTorch's chain (a cast, the bias, the scale, the sigmoid or softplus, lower_bound;
its backward's products, the sums over tokens and the dtype copies: 12 launches, ~2.0 ms of KDA's
fwd + bwd at B1 T8192 H64 K128 on an H100, docs/notes/chunk-backward.md). Bytes per token and
value head at K = 128: forward 256 read (bf16 g_raw) and 512 written; backward 512 + 256 read,
256 written; no products, so bandwidth-bound (~0.2 ms at that shape against ~2.0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastla.backends.triton import cdiv, next_pow2
from fastla.backends.triton.activations import log_decay, log_decay_dx
from fastla.backends.triton.launch import launcher

BLOCK_T = 32        # token rows per program
WARPS = 4


@triton.jit
def _program_tile(rows, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BLOCK_T: tl.constexpr):
    """The program's token block and value head, its tile's offsets and mask ``[BLOCK_T, BK]``
    in ``[rows, HV, K]``, the channels and their mask ``[BK]``."""
    i_t = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m = (t < rows)[:, None] & m_k[None, :]
    return i_t, i_hv, (t[:, None] * HV + i_hv) * K + o_k[None, :], m, o_k, m_k


@triton.jit
def _gate_tile(g_raw, A_log, dt_bias, lower_bound, i_hv, off, m, o_k, m_k, K: tl.constexpr, BOUNDED: tl.constexpr,
               HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``(x, gk, dgk/dx)`` of a tile of g_raw (``[BLOCK_T, BK]``; gk and dgk/dx 0 off ``m``)."""
    x = tl.load(g_raw + off, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    if HAS_A:
        a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        a = 1.0
    gk = log_decay(x, a, lower_bound, BOUNDED)
    dx = log_decay_dx(x, a, lower_bound, BOUNDED)
    return x, tl.where(m, gk, 0.0), tl.where(m, dx, 0.0)


@triton.jit
def _gate_kernel(g_raw, A_log, dt_bias, gk, rows, lower_bound, HV: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr, BLOCK_T: tl.constexpr, BOUNDED: tl.constexpr, HAS_A: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """Program (BLOCK_T token rows, value head): gk float32 ``[BLOCK_T, K]``."""
    i_t, i_hv, off, m, o_k, m_k = _program_tile(rows, HV, K, BK, BLOCK_T)
    _, b_gk, _ = _gate_tile(g_raw, A_log, dt_bias, lower_bound, i_hv, off, m, o_k, m_k, K, BOUNDED, HAS_A, HAS_BIAS)
    tl.store(gk + off, b_gk, mask=m)


@triton.jit
def _gate_grads_kernel(g_raw, A_log, dt_bias, dgk, dg_raw, dbias_part, dA_part, rows, lower_bound,
                       HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BLOCK_T: tl.constexpr,
                       BOUNDED: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program (BLOCK_T token rows, value head): d g_raw ``[BLOCK_T, K]`` in g_raw's dtype, its
    sum over the rows into dbias_part ``[programs, HV, K]`` and the rows' share of d A_log into
    dA_part ``[programs, HV]``."""
    i_t, i_hv, off, m, o_k, m_k = _program_tile(rows, HV, K, BK, BLOCK_T)
    x, b_gk, b_dx = _gate_tile(g_raw, A_log, dt_bias, lower_bound, i_hv, off, m, o_k, m_k, K, BOUNDED, HAS_A,
                               HAS_BIAS)
    b_dgk = tl.load(dgk + off, mask=m, other=0.0).to(tl.float32)
    b_dg = b_dgk * b_dx                                                                   # [BLOCK_T, BK]
    tl.store(dg_raw + off, b_dg.to(dg_raw.dtype.element_ty), mask=m)
    tl.store(dbias_part + (i_t * HV + i_hv) * K + o_k, tl.sum(b_dg, 0), mask=m_k)
    if not BOUNDED:
        b_dA = b_dgk * b_gk                                                               # d(-a sp)/dA = gk
    else:
        b_dA = b_dg * x                                                                   # (a x)' = a x
    tl.store(dA_part + i_t * HV + i_hv, tl.sum(tl.sum(b_dA, 1), 0))


def _launch_shape(g_raw: torch.Tensor):
    HV, K = g_raw.shape[-2:]
    rows = g_raw.numel() // (HV * K)
    return rows, HV, K, (cdiv(rows, BLOCK_T), HV), next_pow2(K)


class KdaGate(torch.autograd.Function):
    """``kda_gate(g_raw, A_log, dt_bias, lower_bound)`` (fastla.core.gates) as two Triton kernels."""

    @staticmethod
    def forward(ctx, g_raw, A_log, dt_bias, lower_bound):
        g_raw = g_raw.contiguous()
        A_log = A_log.contiguous() if A_log is not None else None
        dt_bias = dt_bias.contiguous() if dt_bias is not None else None
        rows, HV, K, grid, BK = _launch_shape(g_raw)
        gk = torch.empty(g_raw.shape, dtype=torch.float32, device=g_raw.device)
        if rows:
            launcher(_gate_kernel)[grid](
                g_raw, A_log if A_log is not None else gk, dt_bias if dt_bias is not None else gk, gk, rows,
                float(lower_bound or 0.0), HV=HV, K=K, BK=BK, BLOCK_T=BLOCK_T, BOUNDED=lower_bound is not None,
                HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None, num_warps=WARPS)
        ctx.save_for_backward(g_raw, A_log, dt_bias)
        ctx.lower_bound = lower_bound
        return gk

    @staticmethod
    def backward(ctx, dgk):
        g_raw, A_log, dt_bias = ctx.saved_tensors
        rows, HV, K, grid, BK = _launch_shape(g_raw)
        dgk = dgk.contiguous()
        dg_raw = torch.empty_like(g_raw)
        dbias_part = torch.zeros(grid[0], HV, K, dtype=torch.float32, device=g_raw.device)
        dA_part = torch.zeros(grid[0], HV, dtype=torch.float32, device=g_raw.device)
        if rows:
            launcher(_gate_grads_kernel)[grid](
                g_raw, A_log if A_log is not None else dgk, dt_bias if dt_bias is not None else dgk, dgk, dg_raw,
                dbias_part, dA_part, rows, float(ctx.lower_bound or 0.0), HV=HV, K=K, BK=BK, BLOCK_T=BLOCK_T,
                BOUNDED=ctx.lower_bound is not None, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None,
                num_warps=WARPS)
        dA = dA_part.sum(0).to(A_log.dtype) if A_log is not None and ctx.needs_input_grad[1] else None
        dbias = (dbias_part.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
                 if dt_bias is not None and ctx.needs_input_grad[2] else None)
        return dg_raw if ctx.needs_input_grad[0] else None, dA, dbias, None


def kda_gate(g_raw: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
             lower_bound: float | None) -> torch.Tensor:
    """KDA's log decay ``[..., HV, K]`` float32 from ``g_raw`` (fastla.core.gates.kda_gate's
    contract; gradients to every input that requires them)."""
    return KdaGate.apply(g_raw, A_log, dt_bias, lower_bound)
