"""The training path's q/k ends in Triton (chunk_training.py): the l2norm of q and k for the
backward's kernels, and the gradients of the op's q and k from the per-value-head ones the
backward computes, in one pass each.

- ``normalize``: ``_normalize_kernel``, grid ``(cdiv(B * T, BLOCK_T), H)``: q and k ``[B, T, H, K]``
  (contiguous) to ``x / sqrt(sum(x^2) + eps)`` in their dtype, the norm taken in float32 (as
  ``fastla.core.gates.l2norm``, FLA's in-kernel l2norm and the forward kernels' in-op one).
- ``input_grads``: ``_input_grads_kernel``, same grid: dq and dk per value head ``[B, T, HV, K]``
  float32 summed over each q/k head's G = HV / H value heads (GVA: value head ``j`` reads head
  ``j // G``), then (l2norm in the op) through the norm's backward
      y = x r,  r = (sum(x^2) + eps)^(-1/2),   dx = r (dy - y sum(dy * y)),
  stored in the input's dtype. It replaces the PyTorch chain that did this (a reduction over the
  group, dtype copies and the autograd of the l2norm: ~20 kernels, ~1.1 ms of a 5.1 ms GDN fwd +
  bwd at B1 T8192 H16 HV32 K128 on an H100; docs/notes/chunk-backward.md).
Bytes per token and q/k head at K = 128: 2 x 512 G (dq, dk per value head, float32) read, 2 x 256
(q, k) read, 2 x 256 written; no products, so bandwidth-bound.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastla.backends.triton import cdiv, next_pow2
from fastla.backends.triton.launch import launcher
from fastla.core.gates import L2NORM_EPS

BLOCK_T = 16        # token rows per program
WARPS = 4


@triton.jit
def _normalize_rows(src, dst, off, m, eps):
    b_x = tl.load(src + off, mask=m, other=0.0).to(tl.float32)                                   # [BLOCK_T, BK]
    b_y = b_x * tl.rsqrt(tl.sum(b_x * b_x, 1) + eps)[:, None]
    tl.store(dst + off, b_y.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _normalize_kernel(q, k, qn, kn, rows, eps, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                      BLOCK_T: tl.constexpr):
    """Program (BLOCK_T token rows, head): qn, kn = l2norm(q), l2norm(k) there."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i_h = tl.program_id(1)
    o_k = tl.arange(0, BK)
    m = (t < rows)[:, None] & (o_k < K)[None, :]
    off = (t.to(tl.int64) * H + i_h)[:, None] * K + o_k[None, :]                                 # [BLOCK_T, BK]
    _normalize_rows(q, qn, off, m, eps)
    _normalize_rows(k, kn, off, m, eps)


@triton.jit
def _input_grad_rows(x, dy_v, dx, off, off_v, m, eps, G: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                     BLOCK_T: tl.constexpr, NORM: tl.constexpr):
    b_dy = tl.zeros([BLOCK_T, BK], dtype=tl.float32)
    for j in tl.static_range(G):
        b_dy += tl.load(dy_v + off_v + j * K, mask=m, other=0.0)                                 # [BLOCK_T, BK]
    if NORM:
        b_x = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) + eps)                                              # [BLOCK_T]
        b_y = b_x * b_r[:, None]
        b_dy = b_r[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, 1)[:, None])
    tl.store(dx + off, b_dy.to(dx.dtype.element_ty), mask=m)


@triton.jit
def _input_grads_kernel(q, k, dq_v, dk_v, dq, dk, rows, eps, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                        BK: tl.constexpr, BLOCK_T: tl.constexpr, NORM: tl.constexpr):
    """Program (BLOCK_T token rows, q/k head): dq, dk of the op's inputs there, from the value
    heads' ``dq_v``, ``dk_v`` (summed over the head's group; NORM: through the l2norm)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i_h = tl.program_id(1)
    o_k = tl.arange(0, BK)
    m = (t < rows)[:, None] & (o_k < K)[None, :]
    row = t.to(tl.int64) * H + i_h
    off = row[:, None] * K + o_k[None, :]                                                       # [BLOCK_T, BK]
    off_v = (row * G)[:, None] * K + o_k[None, :]                                               # the group's first
    _input_grad_rows(q, dq_v, dq, off, off_v, m, eps, G, K, BK, BLOCK_T, NORM)
    _input_grad_rows(k, dk_v, dk, off, off_v, m, eps, G, K, BK, BLOCK_T, NORM)


def normalize(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(l2norm(q), l2norm(k))`` in their dtype, ``q``, ``k`` contiguous ``[B, T, H, K]``."""
    B, T, H, K = q.shape
    qn, kn = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel():
        launcher(_normalize_kernel)[(cdiv(B * T, BLOCK_T), H)](
            q, k, qn, kn, B * T, L2NORM_EPS, H=H, K=K, BK=next_pow2(K), BLOCK_T=BLOCK_T, num_warps=WARPS)
    return qn, kn


def input_grads(q: torch.Tensor, k: torch.Tensor, dq_v: torch.Tensor, dk_v: torch.Tensor,
                norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)`` ``[B, T, H, K]`` in q's and k's dtype from ``dq_v``, ``dk_v`` ``[B, T, HV, K]``
    float32 (contiguous): summed over each head's value heads and, when ``norm``, taken through
    the l2norm of ``q``, ``k`` (the op's raw inputs, contiguous then; only their shape and dtype
    are read otherwise). The results are contiguous."""
    B, T, H, K = q.shape
    HV = dq_v.shape[2]
    dq, dk = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel():
        launcher(_input_grads_kernel)[(cdiv(B * T, BLOCK_T), H)](
            q, k, dq_v, dk_v, dq, dk, B * T, L2NORM_EPS, H=H, G=HV // H, K=K, BK=next_pow2(K), BLOCK_T=BLOCK_T,
            NORM=norm, num_warps=WARPS)
    return dq, dk
