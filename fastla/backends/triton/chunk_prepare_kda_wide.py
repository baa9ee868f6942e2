"""The KDA prologue's wide blocks, exactly (Triton, any CUDA GPU; launched after the sm_90 prologue,
backends/gluon/chunk_prepare_kda_sm90.py, before the inverse kernel).

The sm_90 prologue references a 16-token block's products at the midpoint of its decay, so its
operands reach 2^(+-span / 2); with an unbounded or given gate a block can decay by more than its
limit (SPAN_LIMIT, 200 log2 units) in some channel, or the gate can rise. It then sets bit b of
``flags[chunk, head]`` for each such block b (all four bits when the gate rises anywhere in the
chunk), and this kernel rewrites what depends on those blocks, with every factor <= 1 for a
decaying gate, whatever the span:

- the diagonal block (b, b) of A and Aqk, pair by pair: ``sum_c x_ic k_jc 2^(L_ic - L_jc)``
  (L the cumsum within the block, j <= i) as a [16, 16, BK] tile per slice;
- row block b against earlier columns, referenced at the block's start c_(b-1):
  ``(x 2^(G - c_(b-1))) (k 2^(c_(b-1) - G))^T``, written only in the column blocks whose own bit
  is clear (a flagged column block is its own program's);
- the later rows against column block b, referenced at its end c_b:
  ``(x 2^(G - c_b)) (k 2^(c_b - G))^T``;
- kg = k 2^G, qg = scale q 2^G, kd = k 2^(G_last - G) on the block's rows.
So every entry has one writer: (b, c) with b > c is column block c's program when c is flagged,
else row block b's, else the sm_90 prologue's (its value is right: neither block is wide).

Writes A (strict lower, times beta, fp32 or bf16 scratch) and Aqk (lower, the scores' dtype) ``[B, T, HV,
64]``, kg, kd, qg ``[B, T, HV, K]``; decay (2^G_last) stays the sm_90 prologue's. Two launches
after the list's counter is zeroed: ``_list_blocks_kernel`` lists the flagged blocks (256 flags a
program, one atomic per program to reserve its slots), then ``_kda_wide_blocks_kernel``, persistent
(PROGRAMS_PER_SM x SMs programs of 4 warps), rewrites list entries i, i + programs, ... (a cluster
of flagged blocks, e.g. one head wide in every chunk, spreads over the programs); K in slices of BK
= 16 (the [16, 16, 16] pairwise tile is 32 fp32 per thread; 248 registers, no spill); products in
fp32 (``ieee``). ~1% of blocks are flagged at the registry's softplus gate (A up to 4, no lower
bound), none with the bounded gate (its spans are at most 16 x 5 nats = 115 log2 units). Measured
at 1x8k / 2x16k H64 with the softplus gate: this structure 71 / 53 us (with the 3 us list); a
program per (chunk, head, block) 126 / 231 us (the empty programs: two fit an SM); persistent
programs over contiguous ranges of the flags 214 / 57 us (a range can hold a cluster); the one-warp
Triton prologue over the flagged chunks before this kernel 626 / 522 us (one program's latency per
flagged chunk, two launches); docs/notes/kda-prefill.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastla.backends.triton import sm_count
from fastla.backends.triton.chunk_index import _chunk
from fastla.backends.triton.chunk_prepare import _activate_beta
from fastla.backends.triton.chunk_prepare_kda import _log_decay, gate_mode
from fastla.backends.triton.launch import launcher
from fastla.core import call_plan

FLAGS_READ = tl.constexpr(256)    # flags a program reads at once


@triton.jit
def _rows(x, base, t, n_left, o_k, K: tl.constexpr, stride):
    """Rows t of a chunk's [64, K] tensor at x + base (row stride ``stride``), channels o_k, fp32;
    0 past n_left and K."""
    m = (t < n_left)[:, None] & (o_k < K)[None, :]
    return tl.load(x + base + t[:, None] * stride + o_k[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _inverse_norms(x, base, t, n_left, K: tl.constexpr, BK: tl.constexpr, stride):
    """1 / |x_t| over all K channels (FLA's eps) [len(t)]."""
    acc = tl.zeros(t.shape, dtype=tl.float32)
    for ks in range(0, tl.cdiv(K, BK)):
        r = _rows(x, base, t, n_left, ks * BK + tl.arange(0, BK), K, stride)
        acc += tl.sum(r * r, 1)
    return tl.rsqrt(acc + 1e-6)


@triton.jit(do_not_specialize=["n_flags"])
def _list_blocks_kernel(flags, items, count, n_flags):
    """Work list: the flagged blocks of flags[FLAGS_READ * program_id(0) + ...] (the (chunk, head)
    pairs, head fastest) appended to ``items`` as entry * 4 + block, one atomic per program on
    ``count`` for its range of slots."""
    o = tl.program_id(0) * FLAGS_READ + tl.arange(0, FLAGS_READ)
    f = tl.load(flags + o, mask=o < n_flags, other=0)
    o4 = o[:, None] * 4 + tl.arange(0, 4)[None, :]                          # [FLAGS_READ, 4] (entry, block)
    is_set = ((f[:, None] >> tl.arange(0, 4)[None, :]) & 1) != 0
    rank = tl.reshape(tl.cumsum(tl.reshape(is_set.to(tl.int32), [4 * FLAGS_READ]), 0), [FLAGS_READ, 4])
    n_set = tl.sum(tl.sum(is_set.to(tl.int32), 1), 0)
    if n_set > 0:
        first = tl.atomic_add(count, n_set)
        tl.store(items + first + rank - 1, o4, mask=is_set)


@triton.jit(do_not_specialize=["T", "NT"])
def _kda_wide_blocks_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, scale, a_kk, a_qk, kg, kd, qg, flags, items, count, cu_seqlens,
    chunk_index, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr, VARLEN: tl.constexpr,
    DELTA: tl.constexpr,
):
    """Persistent: program i rewrites the listed blocks i, i + programs, i + 2 programs, ...
    (DELTA False, GLA: their Aqk, qg and kd only; no A nor kg)."""
    for i in range(tl.program_id(0), tl.load(count), tl.num_programs(0)):
        item = tl.load(items + i)
        entry = (item // 4).to(tl.int64)
        _rewrite_block(q, k, g, beta, A_log, dt_bias, lower_bound, scale, a_kk, a_qk, kg, kd, qg, cu_seqlens,
                       chunk_index, T, NT, entry // HV, entry % HV, item % 4, tl.load(flags + entry), H, HV, K, BK,
                       L2NORM, GATE, HAS_A, HAS_BIAS, BETA, VARLEN, DELTA)


@triton.jit
def _rewrite_block(
    q, k, g, beta, A_log, dt_bias, lower_bound, scale, a_kk, a_qk, kg, kd, qg, cu_seqlens, chunk_index, T, NT,
    i_c, i_hv, b, bits, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr, VARLEN: tl.constexpr,
    DELTA: tl.constexpr,
):
    """Block b of chunk i_c, value head i_hv (``bits``: the chunk's flags)."""
    i_h = i_hv // (HV // H)                                                 # GVA: the q/k head
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * 64
    n_left = eos - t0                                                       # tokens of the chunk from t0, >= 1
    qk_row0 = (t0 * H + i_h) * K
    beta_base = t0 * HV + i_hv                                              # chunk row 0 in beta, A, Aqk
    gate_base = beta_base * K                                               # chunk row 0 in g, kg, kd, qg

    r = tl.arange(0, 64)                                                    # chunk rows
    rb = b * 16 + tl.arange(0, 16)                                          # the block's rows
    before = (r < b * 16)[:, None]                                          # rows of earlier blocks
    after = (r >= b * 16 + 16)[:, None]                                     # rows of later blocks
    if L2NORM:
        rk = _inverse_norms(k, qk_row0, r, n_left, K, BK, H * K)
        rq = scale * _inverse_norms(q, qk_row0, r, n_left, K, BK, H * K)
        rk_b = _inverse_norms(k, qk_row0, rb, n_left, K, BK, H * K)
        rq_b = scale * _inverse_norms(q, qk_row0, rb, n_left, K, BK, H * K)
    else:
        rk = tl.full([64], 1.0, tl.float32)
        rq = rk * scale
        rk_b = tl.full([16], 1.0, tl.float32)
        rq_b = rk_b * scale

    z = tl.zeros([16, 64], dtype=tl.float32)
    row_k, row_q = z, z                                                     # row block b x earlier columns
    col_k = tl.zeros([64, 16], dtype=tl.float32)                            # later rows x column block b
    col_q = col_k
    dia_k = tl.zeros([16, 16], dtype=tl.float32)                            # the block's own pairs
    dia_q = dia_k
    i3 = tl.arange(0, 16)[:, None, None]
    j3 = tl.arange(0, 16)[None, :, None]
    lower3 = j3 <= i3
    for ks in range(0, tl.cdiv(K, BK)):
        o_k = ks * BK + tl.arange(0, BK)
        x = _log_decay(g, A_log, dt_bias, lower_bound, gate_base, r, n_left, i_hv, o_k, HV, K, GATE, HAS_A,
                       HAS_BIAS)                                            # [64, BK] log2 decay, 0 past the chunk
        xb = _log_decay(g, A_log, dt_bias, lower_bound, gate_base, rb, n_left, i_hv, o_k, HV, K, GATE, HAS_A,
                        HAS_BIAS)                                           # [16, BK] the block's rows
        start = tl.sum(tl.where(before, x, 0.0), 0)[None, :]                # c_(b-1) [1, BK]
        L = tl.cumsum(xb, 0)                                                # G - c_(b-1) on the block's rows
        span = tl.sum(xb, 0)[None, :]                                       # c_b - c_(b-1)
        kc = _rows(k, qk_row0, r, n_left, o_k, K, H * K) * rk[:, None]     # [64, BK]
        qc = _rows(q, qk_row0, r, n_left, o_k, K, H * K) * rq[:, None]
        kb = _rows(k, qk_row0, rb, n_left, o_k, K, H * K) * rk_b[:, None]  # [16, BK]
        qb = _rows(q, qk_row0, rb, n_left, o_k, K, H * K) * rq_b[:, None]

        # earlier columns j, referenced at c_(b-1): k_j 2^(c_(b-1) - G_j) and 2^(G_i - c_(b-1)) = 2^L
        right = tl.where(before, kc * tl.exp2(start - tl.cumsum(tl.where(before, x, 0.0), 0)), 0.0)
        e_L = tl.exp2(L)
        if DELTA:
            row_k = tl.dot(kb * e_L, tl.trans(right), row_k, input_precision="ieee")
        row_q = tl.dot(qb * e_L, tl.trans(right), row_q, input_precision="ieee")
        # later rows i, referenced at c_b: 2^(G_i - c_b) and k_j 2^(c_b - G_j) = k_j 2^(span - L)
        e_after = tl.where(after, tl.exp2(tl.cumsum(tl.where(after, x, 0.0), 0)), 0.0)
        right_b = kb * tl.exp2(span - L)
        if DELTA:
            col_k = tl.dot(kc * e_after, tl.trans(right_b), col_k, input_precision="ieee")
        col_q = tl.dot(qc * e_after, tl.trans(right_b), col_q, input_precision="ieee")
        # the block's own pairs j <= i: 2^(L_i - L_j) [16, 16, BK]
        e = tl.where(lower3, tl.exp2(tl.where(lower3, L[:, None, :] - L[None, :, :], 0.0)), 0.0)
        ke = kb[None, :, :] * e
        if DELTA:
            dia_k += tl.sum(kb[:, None, :] * ke, 2)
        dia_q += tl.sum(qb[:, None, :] * ke, 2)
        # the gated keys and queries of the block's rows
        G = start + L
        out = gate_base + rb[:, None] * (HV * K) + o_k[None, :]
        m = (rb < n_left)[:, None] & (o_k < K)[None, :]
        e_G = tl.exp2(G)
        if DELTA:
            tl.store(kg + out, (kb * e_G).to(kg.dtype.element_ty), mask=m)
        tl.store(qg + out, (qb * e_G).to(qg.dtype.element_ty), mask=m)
        tl.store(kd + out, (kb * tl.exp2(tl.sum(x, 0)[None, :] - G)).to(kd.dtype.element_ty), mask=m)

    valid_b = rb < n_left
    valid = r < n_left
    if DELTA:
        beta_b = _activate_beta(tl.load(beta + beta_base + rb * HV, mask=valid_b, other=0.0), valid_b, BETA)[:, None]
        beta_r = _activate_beta(tl.load(beta + beta_base + r * HV, mask=valid, other=0.0), valid, BETA)[:, None]
    cols = tl.arange(0, 64)[None, :]
    # row block b in the earlier column blocks whose bit is clear
    mine = (cols < b * 16) & (((bits >> (cols // 16)) & 1) == 0) & valid_b[:, None]
    off_b = ((beta_base + rb * HV) * 64)[:, None] + cols
    if DELTA:
        tl.store(a_kk + off_b, (row_k * beta_b).to(a_kk.dtype.element_ty), mask=mine)
    tl.store(a_qk + off_b, row_q.to(a_qk.dtype.element_ty), mask=mine)
    # the diagonal block, zeros above
    jb = tl.arange(0, 16)[None, :]
    ib = tl.arange(0, 16)[:, None]
    off_d = ((beta_base + rb * HV) * 64 + b * 16)[:, None] + jb
    if DELTA:
        tl.store(a_kk + off_d, tl.where(jb < ib, dia_k * beta_b, 0.0).to(a_kk.dtype.element_ty), mask=valid_b[:, None])
    tl.store(a_qk + off_d, tl.where(jb <= ib, dia_q, 0.0).to(a_qk.dtype.element_ty), mask=valid_b[:, None])
    # column block b in the later rows
    off_c = ((beta_base + r * HV) * 64 + b * 16)[:, None] + jb
    m_c = after & valid[:, None]
    if DELTA:
        tl.store(a_kk + off_c, (col_k * beta_r).to(a_kk.dtype.element_ty), mask=m_c)
    tl.store(a_qk + off_c, col_q.to(a_qk.dtype.element_ty), mask=m_c)


# channels per slice, warps and pipeline stages of a program; programs per SM (persistent)
BLOCK_K = 16
WARPS = 4
STAGES = 1
PROGRAMS_PER_SM = 2


def launch(p, beta, beta_mode: int, total: int, tables, a_kk, scores, kg, kd, qg, flags) -> None:
    """Rewrites the flagged blocks (``flags`` ``[total, HV]`` int32, bit b for block b) of A (fp32
    scratch) and Aqk ``[B, T, HV, 64]`` and of kg, kd, qg ``[B, T, HV, K]`` (GLA,
    ``p.delta`` False: no A nor kg)."""
    cu, chunk_index = tables
    varlen = cu is not None
    NT = -(-p.T // 64)
    n_flags = total * p.HV
    items = call_plan.empty((4 * n_flags,), torch.int32, p.device)
    count = call_plan.full((1,), 0, torch.int32, p.device)
    launcher(_list_blocks_kernel)[(triton.cdiv(n_flags, FLAGS_READ),)](flags, items, count, n_flags, num_warps=4)
    launcher(_kda_wide_blocks_kernel, p.T, NT)[(min(4 * n_flags, PROGRAMS_PER_SM * sm_count(p.device)),)](
        p.q, p.k, p.gk, beta, p.A_log if p.A_log is not None else flags,
        p.dt_bias if p.dt_bias is not None else flags, float(p.lower_bound or 0.0), p.scale,
        a_kk, scores, kg, kd, qg, flags, items, count, cu if varlen else flags, chunk_index if varlen else flags,
        p.T, NT,
        H=p.H, HV=p.HV, K=p.K, BK=BLOCK_K, L2NORM=p.use_qk_l2norm, GATE=gate_mode(p), HAS_A=p.A_log is not None,
        HAS_BIAS=p.dt_bias is not None, BETA=beta_mode, VARLEN=varlen, DELTA=p.delta, num_warps=WARPS,
        num_stages=STAGES,
    )
