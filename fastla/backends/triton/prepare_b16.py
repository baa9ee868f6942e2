"""``_prepare_kernel_b16``: the GDN chunk prepare (kernel 1 of ``chunk_delta``) on 16-row sub-blocks.

Same signature, launch, semantics and outputs as ``chunk_delta._prepare_kernel`` (grid
``(chunks, HV)``, one 64-token chunk of one value head; ``BLOCKED_INVERSE`` is accepted and
ignored), but no 64x64 tensor is ever formed. The chunk is cut into four 16-token blocks
``0..3``; with ``A = strict_lower(beta_i (k_i . k_j) exp(G_i - G_j))`` the matrix ``I + A`` is
block lower triangular:

    [ I+A00                   ]      only the 10 blocks on or below the diagonal exist,
    [ A10   I+A11             ]      each [16, 16] fp32: A_bc = tl.dot(k_b, k_c^T) (DOT
    [ A20   A21   I+A22       ]      operands, k l2-normalised in fp32 then cast) scaled
    [ A30   A31   A32   I+A33 ]      by beta_b and exp(G_b - G_c)

1. P_bb = (I + A_bb)^-1: forward substitution in fp32, the four blocks side by side
   (15 dependent row steps, not 63).
2. The off-diagonal blocks of P = (I + A)^-1, exact, with tf32 16x16x16 products, as a 2x2
   merge of 32-row halves L = {0, 1}, R = {2, 3}: P_RL = -P_RR A_RL P_LL, i.e.
       P10 = -P11 A10 P00,  P32 = -P33 A32 P22                          (depth 2)
       M = A_RL P_LL:  M20 = A20 P00 + A21 P10,  M21 = A21 P11,
                       M30 = A30 P00 + A31 P10,  M31 = A31 P11         (depth 3)
       P2c = -P22 M2c,  P3c = -(P32 M2c + P33 M3c)   for c = 0, 1       (depth 4)
   (16 small products, four dependent, instead of six for row-by-row block substitution).
3. Per 16-row block b: W_b = sum_{c<=b} P_bc (beta exp(G) k / |k|)_c and
   U_b = sum_{c<=b} P_bc (beta v)_c, tf32 dots with fp32 accumulation into one [16, BK] or
   [16, BVF] tile; the row scales are applied to the columns of the [16, 16] P_bc instead of the
   [16, D] tiles, and k, v are read again (from cache) rather than kept live.
Writes W, U (w/u dtype) and G = cumsum(g) (fp32) like the original.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastla.backends.triton.recurrent import _softplus


@triton.jit
def _block_inputs(k, g, beta, A_log, dt_bias, k_row0, g_row0, n_rows, i_hv,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                  L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr):
    """One 16-token block starting at element offsets k_row0 (in k) and g_row0 (in g, beta), of
    which n_rows (may be <= 0) are valid: the normalised keys as DOT [16, BK], 1 / |k| (or 1),
    the gate g (after the GDN transform) and beta, each [16] and 0 on invalid rows."""
    r = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    m_r = r < n_rows
    b_k = tl.load(k + k_row0 + r[:, None] * (H * K) + o_k[None, :],
                  mask=m_r[:, None] & (o_k < K)[None, :], other=0.0).to(tl.float32)          # [16, BK]
    b_rk = tl.full([16], 1.0, tl.float32)
    if L2NORM:
        b_rk = tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)
    b_kd = (b_k * b_rk[:, None]).to(DOT)                                                    # [16, BK]
    b_g = tl.load(g + g_row0 + r * HV, mask=m_r, other=0.0).to(tl.float32)                 # [16]
    if GATE:
        if HAS_BIAS:
            b_g = b_g + tl.load(dt_bias + i_hv).to(tl.float32)
        b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * _softplus(b_g)
        b_g = tl.where(m_r, b_g, 0.0)
    b_beta = tl.load(beta + g_row0 + r * HV, mask=m_r, other=0.0).to(tl.float32)           # [16]
    if BETA >= 2:
        b_beta = tl.where(m_r, tl.sigmoid(b_beta), 0.0)
    if BETA == 3:
        b_beta = 2.0 * b_beta
    return b_kd, b_rk, b_g, b_beta


@triton.jit
def _a_block(kd_b, kd_c, beta_b, G_b, G_c, DIAG: tl.constexpr):
    """A_bc = beta_i (k_i . k_j) exp(G_i - G_j), rows of block b, columns of block c [16, 16] fp32;
    its strictly lower part when b == c (DIAG)."""
    kk = tl.dot(kd_b, tl.trans(kd_c))                                                       # [16, 16] fp32 acc
    if DIAG:
        r = tl.arange(0, 16)
        lower = r[:, None] > r[None, :]
        decay = tl.exp(tl.where(lower, G_b[:, None] - G_c[None, :], 0.0))
        a = tl.where(lower, beta_b[:, None] * kk * decay, 0.0)
    else:
        a = beta_b[:, None] * kk * tl.exp(G_b[:, None] - G_c[None, :])
    return a


@triton.jit
def _unit_lower_inverse16x4(A0, A1, A2, A3):
    """(I + A_b)^-1 of four strictly lower-triangular [16, 16] fp32 blocks by forward substitution,
    side by side: row i of P is e_i - sum_{j<i} A_ij P_j (rows j < i already final)."""
    r = tl.arange(0, 16)
    rows = r[:, None]
    eye = tl.where(rows == r[None, :], 1.0, 0.0)                                            # [16, 16]
    P0 = eye
    P1 = eye
    P2 = eye
    P3 = eye
    for i in range(1, 16):
        sel = rows == i
        a0 = tl.sum(tl.where(sel, A0, 0.0), 0)                                              # A_b[i, :] [16]
        a1 = tl.sum(tl.where(sel, A1, 0.0), 0)
        a2 = tl.sum(tl.where(sel, A2, 0.0), 0)
        a3 = tl.sum(tl.where(sel, A3, 0.0), 0)
        P0 = tl.where(sel, P0 - tl.sum(a0[:, None] * P0, 0)[None, :], P0)
        P1 = tl.where(sel, P1 - tl.sum(a1[:, None] * P1, 0)[None, :], P1)
        P2 = tl.where(sel, P2 - tl.sum(a2[:, None] * P2, 0)[None, :], P2)
        P3 = tl.where(sel, P3 - tl.sum(a3[:, None] * P3, 0)[None, :], P3)
    return P0, P1, P2, P3


@triton.jit
def _mm(a, b):
    """[16, 16] x [16, 16] fp32 product on tensor cores (tf32 operands, fp32 accumulation)."""
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _apply_rows(P0, P1, P2, P3, s0, s1, s2, s3, src, src_stride, dst, dst_stride, n_left,
                B: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """Row block B of P diag(s) X: sum_{c<=B} (P_Bc * s_c) X_c [16, BD] with X_c the 16 rows of block
    c at src (row stride src_stride, D columns), tf32 dots, fp32 accumulation; stored at dst (the
    chunk's first row) in dst's dtype. n_left: valid rows of the chunk. P_Bc for c > B are unused."""
    r = tl.arange(0, 16)
    o_d = tl.arange(0, BD)
    m_d = (o_d < D)[None, :]
    off = r[:, None] * src_stride + o_d[None, :]                                            # [16, BD]
    x = tl.load(src + off, mask=(r < n_left)[:, None] & m_d, other=0.0).to(tl.float32)
    acc = tl.dot(P0 * s0[None, :], x, input_precision="tf32")                              # [16, BD]
    if B >= 1:
        x = tl.load(src + 16 * src_stride + off, mask=(r < n_left - 16)[:, None] & m_d, other=0.0).to(tl.float32)
        acc = tl.dot(P1 * s1[None, :], x, acc, input_precision="tf32")
    if B >= 2:
        x = tl.load(src + 32 * src_stride + off, mask=(r < n_left - 32)[:, None] & m_d, other=0.0).to(tl.float32)
        acc = tl.dot(P2 * s2[None, :], x, acc, input_precision="tf32")
    if B >= 3:
        x = tl.load(src + 48 * src_stride + off, mask=(r < n_left - 48)[:, None] & m_d, other=0.0).to(tl.float32)
        acc = tl.dot(P3 * s3[None, :], x, acc, input_precision="tf32")
    p_out = dst + (B * 16 + r)[:, None] * dst_stride + o_d[None, :]
    tl.store(p_out, acc.to(dst.dtype.element_ty), mask=(r < n_left - B * 16)[:, None] & m_d)


@triton.jit
def _prepare_kernel_b16(
    k, v, g, beta, A_log, dt_bias, w, u, gcum, cu_seqlens, chunk_index, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, DOT: tl.constexpr,
    L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
    VARLEN: tl.constexpr, BLOCKED_INVERSE: tl.constexpr,
):
    tl.static_assert(BT == 64, "four 16-token blocks")
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)                                                 # GVA: the q/k head
    if VARLEN:
        i_n = tl.load(chunk_index + 2 * i_c).to(tl.int64)
        c = tl.load(chunk_index + 2 * i_c + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:                                                                   # dense: NT chunks per sequence
        i_n = (i_c // NT).to(tl.int64)
        c = (i_c % NT).to(tl.int64)
        bos = i_n * T
        eos = bos + T
    t0 = bos + c * BT                                                       # first token (int64)
    n_left = eos - t0                                                       # valid tokens of the chunk, >= 1
    base = t0 * HV + i_hv                                                   # chunk row 0 in g, beta, gcum
    k_base = (t0 * H + i_h) * K                                             # chunk row 0 in k

    # ---- inputs per 16-token block: keys [16, BK] (DOT), 1/|k|, g, beta [16]
    kd0, rk0, g0, be0 = _block_inputs(k, g, beta, A_log, dt_bias, k_base, base, n_left, i_hv,
                                      H, HV, K, BK, DOT, L2NORM, GATE, HAS_BIAS, BETA)
    kd1, rk1, g1, be1 = _block_inputs(k, g, beta, A_log, dt_bias, k_base + 16 * H * K, base + 16 * HV,
                                      n_left - 16, i_hv, H, HV, K, BK, DOT, L2NORM, GATE, HAS_BIAS, BETA)
    kd2, rk2, g2, be2 = _block_inputs(k, g, beta, A_log, dt_bias, k_base + 32 * H * K, base + 32 * HV,
                                      n_left - 32, i_hv, H, HV, K, BK, DOT, L2NORM, GATE, HAS_BIAS, BETA)
    kd3, rk3, g3, be3 = _block_inputs(k, g, beta, A_log, dt_bias, k_base + 48 * H * K, base + 48 * HV,
                                      n_left - 48, i_hv, H, HV, K, BK, DOT, L2NORM, GATE, HAS_BIAS, BETA)

    # ---- G = cumsum(g) over the chunk, per block [16]
    r = tl.arange(0, 16)
    G0 = tl.cumsum(g0, 0)
    carry = tl.sum(g0, 0)
    G1 = carry + tl.cumsum(g1, 0)
    carry += tl.sum(g1, 0)
    G2 = carry + tl.cumsum(g2, 0)
    carry += tl.sum(g2, 0)
    G3 = carry + tl.cumsum(g3, 0)
    tl.store(gcum + base + r * HV, G0, mask=r < n_left)
    tl.store(gcum + base + (16 + r) * HV, G1, mask=r < n_left - 16)
    tl.store(gcum + base + (32 + r) * HV, G2, mask=r < n_left - 32)
    tl.store(gcum + base + (48 + r) * HV, G3, mask=r < n_left - 48)

    # ---- the 10 blocks of A on and below the diagonal, [16, 16] fp32 each
    A00 = _a_block(kd0, kd0, be0, G0, G0, True)
    A11 = _a_block(kd1, kd1, be1, G1, G1, True)
    A22 = _a_block(kd2, kd2, be2, G2, G2, True)
    A33 = _a_block(kd3, kd3, be3, G3, G3, True)
    A10 = _a_block(kd1, kd0, be1, G1, G0, False)
    A20 = _a_block(kd2, kd0, be2, G2, G0, False)
    A21 = _a_block(kd2, kd1, be2, G2, G1, False)
    A30 = _a_block(kd3, kd0, be3, G3, G0, False)
    A31 = _a_block(kd3, kd1, be3, G3, G1, False)
    A32 = _a_block(kd3, kd2, be3, G3, G2, False)

    # ---- P = (I + A)^-1: diagonal blocks by forward substitution, the rest by an exact 2x2 merge
    P00, P11, P22, P33 = _unit_lower_inverse16x4(A00, A11, A22, A33)
    P10 = -_mm(P11, _mm(A10, P00))
    P32 = -_mm(P33, _mm(A32, P22))
    M20 = tl.dot(A21, P10, _mm(A20, P00), input_precision="tf32")          # M = A_RL P_LL
    M21 = _mm(A21, P11)
    M30 = tl.dot(A31, P10, _mm(A30, P00), input_precision="tf32")
    M31 = _mm(A31, P11)
    P20 = -_mm(P22, M20)                                                    # P_RL = -P_RR M
    P21 = -_mm(P22, M21)
    P30 = -tl.dot(P33, M30, _mm(P32, M20), input_precision="tf32")
    P31 = -tl.dot(P33, M31, _mm(P32, M21), input_precision="tf32")

    # ---- W = P (beta exp(G) k / |k|), U = P (beta v), one 16-row block at a time
    sk0 = rk0 * be0 * tl.exp(G0)
    sk1 = rk1 * be1 * tl.exp(G1)
    sk2 = rk2 * be2 * tl.exp(G2)
    sk3 = rk3 * be3 * tl.exp(G3)
    k_src = k + k_base
    v_src = v + base * V
    w_dst = w + base * K
    u_dst = u + base * V
    _apply_rows(P00, P00, P00, P00, sk0, sk0, sk0, sk0, k_src, H * K, w_dst, HV * K, n_left, 0, K, BK)
    _apply_rows(P00, P00, P00, P00, be0, be0, be0, be0, v_src, HV * V, u_dst, HV * V, n_left, 0, V, BVF)
    if n_left > 16:
        _apply_rows(P10, P11, P11, P11, sk0, sk1, sk1, sk1, k_src, H * K, w_dst, HV * K, n_left, 1, K, BK)
        _apply_rows(P10, P11, P11, P11, be0, be1, be1, be1, v_src, HV * V, u_dst, HV * V, n_left, 1, V, BVF)
    if n_left > 32:
        _apply_rows(P20, P21, P22, P22, sk0, sk1, sk2, sk2, k_src, H * K, w_dst, HV * K, n_left, 2, K, BK)
        _apply_rows(P20, P21, P22, P22, be0, be1, be2, be2, v_src, HV * V, u_dst, HV * V, n_left, 2, V, BVF)
    if n_left > 48:
        _apply_rows(P30, P31, P32, P33, sk0, sk1, sk2, sk3, k_src, H * K, w_dst, HV * K, n_left, 3, K, BK)
        _apply_rows(P30, P31, P32, P33, be0, be1, be2, be3, v_src, HV * V, u_dst, HV * V, n_left, 3, V, BVF)
