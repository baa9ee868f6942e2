"""Token-parallel prologue of the GDN chunked forward (Triton and Gluon tiers): per 64-token chunk
the WY factor P and the causal scores; for the plain rule with a scalar gate (Simple GLA,
Lightning) ``_gate_cumsum_kernel`` writes G alone, before the same scores kernel.

``_inverse_kernel``, grid ``(chunks, HV / VPP)``: one chunk of VPP value heads that share a q/k
head (GVA; up to 4 while the grid keeps 6 programs per SM, ``values_per_program``). With
G = cumsum(g) over the chunk and unit keys (l2norm in the op) or raw keys:
    A = strict_lower(beta_i (k_i . k_j) exp(G_i - G_j))   [BT, BT],   P = (I + A)^-1
The Gram matrix of the chunk's keys is formed once per program, as its ten lower [16, 16] blocks
(bf16 products, fp32 accumulation, over K in slices of BK; the key norms from the same loads,
applied to the blocks afterwards); for each value head the gate and beta make A's blocks, the four
diagonal blocks are inverted by forward substitution (15 row steps each, fp32, the rows of A
read back from P's output rows where they wait in fp32), and the six lower blocks follow by block
forward substitution on tensor cores (tf32, exact: no series).
Writes P ``[B, T, HV, BT]`` (whole rows of the chunk, zero above the block diagonal, so that
the Gluon scan can load whole tiles) in the product dtype and G ``[B, T, HV]`` in fp32. The scan
(chunk_delta.py) forms W = P (beta e^G k) and U = P (beta v) implicitly, so they never reach HBM.

``_scores_kernel``, grid ``(chunks, H)``, 4 warps: q k^T [BT, BT] once per q/k head (one wgmma),
1 / |q| and 1 / |k| per token (stored [B, T, H] fp32), and for each of the head's value heads
the causal scores scale diag(rq) q k^T diag(rk) e^(G_i - G_j) ``[B, T, HV, BT]`` (bf16, whole
rows) that the scan multiplies with V_new.

Budgets (sm_90, K = V = 128, checked in tests/backends/test_triton_sm90.py): the inverse one
warp, 255 registers, 8 bytes of spill, mma.sync for the 16x16 products (too small for a warpgroup); the
scores 127 registers. Traffic per token and value head: 128 bytes of P and 128 of scores
written (bf16), q and k read once per GVA group by each kernel.
Measurements: docs/notes/gdn-prefill.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastla.backends.triton import cdiv, next_pow2, sm_count
from fastla.backends.triton.activations import activate_beta, log_decay
from fastla.backends.triton.chunk_index import BT, _chunk
from fastla.backends.triton.launch import launcher


@triton.jit
def _activate_beta(b, mask, BETA: tl.constexpr):
    """beta as the op defines it (activations.activate_beta); 0 off ``mask`` (where a raw beta's
    sigmoid would not be)."""
    b = activate_beta(b, BETA)
    if BETA >= 2:
        b = tl.where(mask, b, 0.0)
    return b


@triton.jit
def _gdn_gate(x, m, A_log, dt_bias, i_hv, HAS_BIAS: tl.constexpr):
    """GDN's gate computed in the op, -exp(A_log) softplus(x + dt_bias) for value head i_hv; 0 where
    not ``m`` (also called from the sm_90 inverse kernel, gluon/chunk_inverse_sm90.py)."""
    if HAS_BIAS:
        x = x + tl.load(dt_bias + i_hv).to(tl.float32)
    return tl.where(m, log_decay(x, tl.exp(tl.load(A_log + i_hv).to(tl.float32)), 0.0, False), 0.0)


@triton.jit
def _gate_block(g, beta, A_log, dt_bias, base, blk: tl.constexpr, n_left, i_hv, HV: tl.constexpr,
                GATE: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr):
    """Gate (after the GDN transform when GATE) and beta of the 16 tokens of block ``blk`` [16]; 0
    from token n_left on. ``base`` is the chunk's first row in g / beta (element offset)."""
    t = blk * 16 + tl.arange(0, 16)
    m = t < n_left
    b_g = tl.load(g + base + t * HV, mask=m, other=0.0).to(tl.float32)
    if GATE:
        b_g = _gdn_gate(b_g, m, A_log, dt_bias, i_hv, HAS_BIAS)
    b_beta = _activate_beta(tl.load(beta + base + t * HV, mask=m, other=0.0), m, BETA)
    return b_g, b_beta


@triton.jit
def _key_block(k, base, blk: tl.constexpr, n_left, o_k, K: tl.constexpr, stride):
    """Rows 16 blk .. 16 blk + 15 of the chunk's keys, columns o_k [16, BK]; 0 outside."""
    t = blk * 16 + tl.arange(0, 16)
    return tl.load(k + base + t[:, None] * stride + o_k[None, :], mask=(t < n_left)[:, None] & (o_k < K)[None, :],
                   other=0.0)


@triton.jit
def _a_block(gram, rk_i, rk_j, beta_i, G_i, G_j, DIAG: tl.constexpr):
    """Block of A from a Gram block [16, 16]: beta_i (k_i . k_j) / (|k_i| |k_j|) exp(G_i - G_j),
    strictly lower on a diagonal block (the exponent is clamped where it is not used)."""
    d = G_i[:, None] - G_j[None, :]
    x = gram * (beta_i * rk_i)[:, None] * rk_j[None, :]
    if DIAG:
        r = tl.arange(0, 16)
        lower = r[:, None] > r[None, :]
        x = tl.where(lower, x * tl.exp(tl.where(lower, d, 0.0)), 0.0)
    else:
        x = x * tl.exp(d)
    return x


@triton.jit
def _diag_inverse(A0, A1, A2, A3):
    """(I + A_b)^-1 of four strictly lower [16, 16] blocks at once, by forward substitution:
    row i of P_b is e_i - sum_{j<i} A_b[i, j] P_b[j, :] (rows j < i final). A's rows are read as
    columns of its transpose, so each step's reductions need no layout change."""
    r = tl.arange(0, 16)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    T0 = tl.trans(A0)
    T1 = tl.trans(A1)
    T2 = tl.trans(A2)
    T3 = tl.trans(A3)
    P0 = eye
    P1 = eye
    P2 = eye
    P3 = eye
    for i in range(1, 16):
        col = r[None, :] == i
        row = r[:, None] == i
        P0 = tl.where(row, P0 - tl.sum(tl.sum(tl.where(col, T0, 0.0), 1)[:, None] * P0, 0)[None, :], P0)
        P1 = tl.where(row, P1 - tl.sum(tl.sum(tl.where(col, T1, 0.0), 1)[:, None] * P1, 0)[None, :], P1)
        P2 = tl.where(row, P2 - tl.sum(tl.sum(tl.where(col, T2, 0.0), 1)[:, None] * P2, 0)[None, :], P2)
        P3 = tl.where(row, P3 - tl.sum(tl.sum(tl.where(col, T3, 0.0), 1)[:, None] * P3, 0)[None, :], P3)
    return P0, P1, P2, P3


@triton.jit
def _diag_inverse_rows(a, row0, col0, blk: tl.constexpr, n_left, stride):
    """(I + A_bb)^-1 of diagonal block ``blk`` [16, 16] of a strictly lower [64, 64] A in memory
    (the block's row i at a + row0 + (16 blk + i) * stride + col0, zero on and above the diagonal),
    by forward substitution with each row of A loaded where it is needed: one reduction per row
    step instead of _diag_inverse's two (it extracts A's rows from registers). sm_90 SASS of the
    KDA inverse kernel: 2080 against 5880 instructions (the loop unrolled), 156 against 2052 SHFL."""
    r = tl.arange(0, 16)
    P = tl.where(r[:, None] == r[None, :], 1.0, 0.0)                                           # [16, 16]
    for i in tl.static_range(1, 16):
        t = blk * 16 + i
        a_row = tl.load(a + row0 + t * stride + col0 + r, mask=(r < i) & (t < n_left), other=0.0).to(tl.float32)
        P = tl.where(r[:, None] == i, P - tl.sum(a_row[:, None] * P, 0)[None, :], P)
    return P


@triton.jit
def _diag_inverses_rows(a, row0, COL_STEP: tl.constexpr, n_left, stride):
    """The four diagonal blocks' (I + A_bb)^-1 by _diag_inverse_rows, block b's rows read at
    columns b * COL_STEP (16: A's own [64, 64] rows; 0: rows holding only their block)."""
    p00 = _diag_inverse_rows(a, row0, 0, 0, n_left, stride)                                    # [16, 16] each
    p11 = _diag_inverse_rows(a, row0, COL_STEP, 1, n_left, stride)
    p22 = _diag_inverse_rows(a, row0, 2 * COL_STEP, 2, n_left, stride)
    p33 = _diag_inverse_rows(a, row0, 3 * COL_STEP, 3, n_left, stride)
    return p00, p11, p22, p33


@triton.jit
def _store_rows(out, row0, X, blk: tl.constexpr, n_left, stride):
    """Block ``blk``'s rows of X [16, 16] at out + row0 + (16 blk + i) * stride, columns 0-15
    (rows of the chunk only)."""
    r = tl.arange(0, 16)
    t = blk * 16 + r
    tl.store(out + row0 + t[:, None] * stride + r[None, :], X, mask=(t < n_left)[:, None])


@triton.jit
def _mm(a, b):
    """[16, 16] x [16, 16] on tensor cores, tf32 operands and fp32 accumulation (FLA's merge precision)."""
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _store_block(out, row0, X, bi: tl.constexpr, bj: tl.constexpr, n_left, stride, BT: tl.constexpr):
    """Block (bi, bj) [16, 16] of a chunk's [BT, BT] matrix stored at out + row0 (row stride
    ``stride``), rows of the chunk only."""
    r = tl.arange(0, 16)
    t = bi * 16 + r
    tl.store(out + row0 + t[:, None] * stride + (bj * 16 + r)[None, :], X.to(out.dtype.element_ty),
             mask=(t < n_left)[:, None])


@triton.jit
def _lower_inverse(a00, a10, a11, a20, a21, a22, a30, a31, a32, a33):
    """P = (I + A)^-1 of a strictly lower [64, 64] A given as its ten lower [16, 16] blocks a_bc:
    the four diagonal blocks by forward substitution, the six below by block forward
    substitution P_bc = -P_bb sum_(c <= d < b) A_bd P_dc (tf32 products). Returns P's blocks."""
    p00, p11, p22, p33 = _diag_inverse(a00, a11, a22, a33)
    p10, p20, p21, p30, p31, p32 = _lower_merge(p00, p11, p22, p33, a10, a20, a21, a30, a31, a32)
    return p00, p10, p11, p20, p21, p22, p30, p31, p32, p33


@triton.jit
def _lower_merge(p00, p11, p22, p33, a10, a20, a21, a30, a31, a32):
    """The six blocks of P = (I + A)^-1 below its diagonal from the diagonal blocks' inverses p_bb
    and A's lower blocks a_bc, by block forward substitution P_bc = -P_bb sum_(c <= d < b) A_bd P_dc
    (tf32 products)."""
    p10 = -_mm(p11, _mm(a10, p00))
    p21 = -_mm(p22, _mm(a21, p11))
    p32 = -_mm(p33, _mm(a32, p22))
    p20 = -_mm(p22, _mm(a20, p00) + _mm(a21, p10))
    p31 = -_mm(p33, _mm(a31, p11) + _mm(a32, p21))
    p30 = -_mm(p33, _mm(a30, p00) + _mm(a31, p10) + _mm(a32, p20))
    return p10, p20, p21, p30, p31, p32


@triton.jit
def _store_lower(out, row0, x00, x10, x11, x20, x21, x22, x30, x31, x32, x33, n_left, stride, BT: tl.constexpr):
    """A chunk's block-lower [BT, BT] matrix from its ten lower [16, 16] blocks, zeros in the six
    above (whole rows, so that the scans can load whole tiles), at out + row0 (row stride ``stride``)."""
    zero = tl.zeros([16, 16], dtype=tl.float32)
    _store_block(out, row0, x00, 0, 0, n_left, stride, BT)
    _store_block(out, row0, zero, 0, 1, n_left, stride, BT)
    _store_block(out, row0, zero, 0, 2, n_left, stride, BT)
    _store_block(out, row0, zero, 0, 3, n_left, stride, BT)
    _store_block(out, row0, x10, 1, 0, n_left, stride, BT)
    _store_block(out, row0, x11, 1, 1, n_left, stride, BT)
    _store_block(out, row0, zero, 1, 2, n_left, stride, BT)
    _store_block(out, row0, zero, 1, 3, n_left, stride, BT)
    _store_block(out, row0, x20, 2, 0, n_left, stride, BT)
    _store_block(out, row0, x21, 2, 1, n_left, stride, BT)
    _store_block(out, row0, x22, 2, 2, n_left, stride, BT)
    _store_block(out, row0, zero, 2, 3, n_left, stride, BT)
    _store_block(out, row0, x30, 3, 0, n_left, stride, BT)
    _store_block(out, row0, x31, 3, 1, n_left, stride, BT)
    _store_block(out, row0, x32, 3, 2, n_left, stride, BT)
    _store_block(out, row0, x33, 3, 3, n_left, stride, BT)


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _inverse_kernel(
    k, g, beta, A_log, dt_bias, p_out, gcum, cu_seqlens, chunk_index, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    VPP: tl.constexpr, DOT: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BETA: tl.constexpr, VARLEN: tl.constexpr,
):
    tl.static_assert(BT == 64, "four 16-token blocks")
    i_c = tl.program_id(0)
    hv0 = tl.program_id(1) * VPP                                            # VPP value heads of one q/k head
    i_h = hv0 // (HV // H)
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c.to(tl.int64), T, NT, VARLEN)
    t0 = bos + c * BT                                                       # first token (int64)
    n_left = eos - t0                                                       # tokens of the chunk from t0, >= 1
    k_row0 = (t0 * H + i_h) * K

    # Gram blocks K_b K_c^T [16, 16] (b >= c) and squared key norms [16], over K in slices of BK
    z = tl.zeros([16, 16], dtype=tl.float32)
    g00, g10, g11, g20, g21, g22, g30, g31, g32, g33 = z, z, z, z, z, z, z, z, z, z
    s0 = tl.zeros([16], dtype=tl.float32)
    s1, s2, s3 = s0, s0, s0
    for j in range(0, tl.cdiv(K, BK)):
        o_k = j * BK + tl.arange(0, BK)
        k0 = _key_block(k, k_row0, 0, n_left, o_k, K, H * K)                                 # [16, BK]
        k1 = _key_block(k, k_row0, 1, n_left, o_k, K, H * K)
        k2 = _key_block(k, k_row0, 2, n_left, o_k, K, H * K)
        k3 = _key_block(k, k_row0, 3, n_left, o_k, K, H * K)
        if L2NORM:
            s0 += tl.sum(k0.to(tl.float32) * k0.to(tl.float32), 1)
            s1 += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), 1)
            s2 += tl.sum(k2.to(tl.float32) * k2.to(tl.float32), 1)
            s3 += tl.sum(k3.to(tl.float32) * k3.to(tl.float32), 1)
        k0, k1, k2, k3 = k0.to(DOT), k1.to(DOT), k2.to(DOT), k3.to(DOT)
        g00 = tl.dot(k0, tl.trans(k0), g00)
        g10 = tl.dot(k1, tl.trans(k0), g10)
        g11 = tl.dot(k1, tl.trans(k1), g11)
        g20 = tl.dot(k2, tl.trans(k0), g20)
        g21 = tl.dot(k2, tl.trans(k1), g21)
        g22 = tl.dot(k2, tl.trans(k2), g22)
        g30 = tl.dot(k3, tl.trans(k0), g30)
        g31 = tl.dot(k3, tl.trans(k1), g31)
        g32 = tl.dot(k3, tl.trans(k2), g32)
        g33 = tl.dot(k3, tl.trans(k3), g33)
    # 1 / |k| per row, for both sides of the Gram blocks
    if L2NORM:
        r0, r1, r2, r3 = tl.rsqrt(s0 + 1e-6), tl.rsqrt(s1 + 1e-6), tl.rsqrt(s2 + 1e-6), tl.rsqrt(s3 + 1e-6)
    else:
        r0 = tl.full([16], 1.0, tl.float32)
        r1, r2, r3 = r0, r0, r0

    for jv in range(VPP):
        i_hv = hv0 + jv
        base = t0 * HV + i_hv                                               # chunk row 0 in g, beta, gcum
        x0, b0 = _gate_block(g, beta, A_log, dt_bias, base, 0, n_left, i_hv, HV, GATE, HAS_BIAS, BETA)
        x1, b1 = _gate_block(g, beta, A_log, dt_bias, base, 1, n_left, i_hv, HV, GATE, HAS_BIAS, BETA)
        x2, b2 = _gate_block(g, beta, A_log, dt_bias, base, 2, n_left, i_hv, HV, GATE, HAS_BIAS, BETA)
        x3, b3 = _gate_block(g, beta, A_log, dt_bias, base, 3, n_left, i_hv, HV, GATE, HAS_BIAS, BETA)
        G0 = tl.cumsum(x0, 0)                                                                  # [16] each
        G1 = tl.cumsum(x1, 0) + tl.sum(x0, 0)
        G2 = tl.cumsum(x2, 0) + (tl.sum(x0, 0) + tl.sum(x1, 0))
        G3 = tl.cumsum(x3, 0) + (tl.sum(x0, 0) + tl.sum(x1, 0) + tl.sum(x2, 0))
        r16 = tl.arange(0, 16)
        tl.store(gcum + base + r16 * HV, G0, mask=r16 < n_left)
        tl.store(gcum + base + (16 + r16) * HV, G1, mask=16 + r16 < n_left)
        tl.store(gcum + base + (32 + r16) * HV, G2, mask=32 + r16 < n_left)
        tl.store(gcum + base + (48 + r16) * HV, G3, mask=48 + r16 < n_left)

        a00 = _a_block(g00, r0, r0, b0, G0, G0, True)
        a11 = _a_block(g11, r1, r1, b1, G1, G1, True)
        a22 = _a_block(g22, r2, r2, b2, G2, G2, True)
        a33 = _a_block(g33, r3, r3, b3, G3, G3, True)
        a10 = _a_block(g10, r1, r0, b1, G1, G0, False)
        a21 = _a_block(g21, r2, r1, b2, G2, G1, False)
        a32 = _a_block(g32, r3, r2, b3, G3, G2, False)
        a20 = _a_block(g20, r2, r0, b2, G2, G0, False)
        a31 = _a_block(g31, r3, r1, b3, G3, G1, False)
        a30 = _a_block(g30, r3, r0, b3, G3, G0, False)
        # the diagonal blocks through memory, each row read where the substitution needs it
        # (_diag_inverse_rows; 1x32k HV64: 478 -> 366 us against extracting the rows from
        # registers): P's own rows hold them in fp32 until P is stored over them (a row of 64 bf16
        # or fp32 elements has room for 32 or 64 fp32 words, 16 used); the barriers order the
        # writes, the reads and P's stores among the program's threads
        bits: tl.constexpr = p_out.dtype.element_ty.primitive_bitwidth
        scratch = p_out.to(tl.pointer_type(tl.float32), bitcast=True)
        s_row0 = base * BT * bits // 32
        s_stride = HV * BT * bits // 32
        _store_rows(scratch, s_row0, a00, 0, n_left, s_stride)
        _store_rows(scratch, s_row0, a11, 1, n_left, s_stride)
        _store_rows(scratch, s_row0, a22, 2, n_left, s_stride)
        _store_rows(scratch, s_row0, a33, 3, n_left, s_stride)
        tl.debug_barrier()
        p00, p11, p22, p33 = _diag_inverses_rows(scratch, s_row0, 0, n_left, s_stride)
        tl.debug_barrier()
        p10, p20, p21, p30, p31, p32 = _lower_merge(p00, p11, p22, p33, a10, a20, a21, a30, a31, a32)
        _store_lower(p_out, base * BT, p00, p10, p11, p20, p21, p22, p30, p31, p32, p33, n_left, HV * BT, BT)


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _scores_kernel(
    q, k, gcum, a_out, rq_out, rk_out, cu_seqlens, chunk_index, T, NT, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT: tl.constexpr, L2NORM: tl.constexpr, VARLEN: tl.constexpr,
):
    """Program (chunk, q/k head): q k^T [BT, BT] once, then for each of the head's HV / H value
    heads the causal scores scale diag(rq) q k^T diag(rk) e^(G_i - G_j) (bf16, diagonal included);
    with the l2norm also 1 / |q| and 1 / |k| per token."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c.to(tl.int64), T, NT, VARLEN)
    t0 = bos + c * BT
    r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = r < eos - t0
    m_k = o_k < K
    row0 = (t0 * H + i_h) * K
    b_q = tl.load(q + row0 + r[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_kt = tl.load(k + row0 + o_k[:, None] + r[None, :] * (H * K), mask=m_k[:, None] & m_t[None, :], other=0.0)
    b_qk = tl.dot(b_q.to(DOT), b_kt.to(DOT)) * scale                                       # [BT, BT]
    if L2NORM:
        b_rq = tl.rsqrt(tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), 1) + 1e-6)            # [BT]
        b_rk = tl.rsqrt(tl.sum(b_kt.to(tl.float32) * b_kt.to(tl.float32), 0) + 1e-6)          # [BT]
        tl.store(rq_out + (t0 + r) * H + i_h, b_rq, mask=m_t)
        tl.store(rk_out + (t0 + r) * H + i_h, b_rk, mask=m_t)
        b_qk = b_qk * b_rq[:, None] * b_rk[None, :]
    causal = r[:, None] >= r[None, :]
    for j in range(HV // H):                                                # the value heads of this q/k head
        base = t0 * HV + i_h * (HV // H) + j                                # chunk row 0 in gcum
        b_G = tl.load(gcum + base + r * HV, mask=m_t, other=0.0)
        b_A = tl.where(causal, b_qk * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
        tl.store(a_out + base * BT + r[:, None] * (HV * BT) + r[None, :], b_A.to(a_out.dtype.element_ty),
                 mask=m_t[:, None])


# the inverse's one-warp programs (255 registers) fit 8 per SM; sharing a program's Gram blocks
# among value heads pays only while the grid keeps at least this many programs per SM: at 1x8k
# HV 8 (1024 chunk-heads), 4 heads a program took 47 us and 1 head 17 us; at 1x32k HV 8, 4 heads
# 88 us and 1 head 103 (benchmarks/results/gdn_prefill_sweep-v11-small-heads.json, -v6-1.json)
INVERSE_PROGRAMS_PER_SM = 6


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _gate_cumsum_kernel(g, g_gamma, gcum, cu_seqlens, chunk_index, T, NT, HV: tl.constexpr, BT: tl.constexpr,
                        HAS_G: tl.constexpr, HAS_GAMMA: tl.constexpr, VARLEN: tl.constexpr):
    """The plain rule's prologue with a scalar gate (Simple GLA, Lightning): per chunk and head,
    G = cumsum(g) + g_gamma (i + 1) over the chunk's tokens i (either term absent when not given),
    into ``gcum`` ``[B, T, HV]`` fp32 (what the inverse kernel writes for GDN). Grid (chunks, HV)."""
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * BT
    r = tl.arange(0, BT)
    m = r < eos - t0
    rows = (t0 + r) * HV + i_hv                                                                 # [BT]
    G = tl.zeros([BT], dtype=tl.float32)
    if HAS_G:
        G = tl.cumsum(tl.load(g + rows, mask=m, other=0.0).to(tl.float32), 0)
    if HAS_GAMMA:
        G += tl.load(g_gamma + i_hv).to(tl.float32) * (r + 1).to(tl.float32)
    tl.store(gcum + rows, G, mask=m)


def values_per_program(ratio: int, limit: int, chunk_heads: int, sms: int) -> int:
    """Value heads per inverse program: the largest divisor of the GVA ratio HV / H up to ``limit``
    (their Gram blocks are shared) that leaves INVERSE_PROGRAMS_PER_SM programs per SM over the
    ``chunk_heads`` (chunks x HV) pairs, else 1."""
    fits = [d for d in range(1, min(ratio, limit) + 1)
            if ratio % d == 0 and (d == 1 or chunk_heads // d >= INVERSE_PROGRAMS_PER_SM * sms)]
    return max(fits)


def launch(p, g, beta, beta_mode: int, total: int, tables, gcum, inverse, dot, config) -> None:
    """Runs the inverse kernel for ``total`` chunks: g and beta as the kernels read them (raw),
    ``tables`` = (cu_seqlens, chunk index) or Nones (dense); writes G into ``gcum`` ``[B, T, HV]``
    and P into ``inverse`` ``[B, T, HV, BT]``."""
    T, H, HV, K = p.T, p.H, p.HV, p.K
    NT = cdiv(T, BT)
    cu, chunk_index = tables
    varlen = cu is not None
    dummy = gcum
    vpp = values_per_program(HV // H, config.inverse_heads, total * HV, sm_count(p.device))
    BK = min(64, max(16, next_pow2(K)))
    launcher(_inverse_kernel, T, NT)[(total, HV // vpp)](
        p.k, g, beta, p.A_log if p.A_log is not None else dummy, p.dt_bias if p.dt_bias is not None else dummy,
        inverse, gcum, cu if varlen else dummy, chunk_index if varlen else dummy,
        T, NT, H=H, HV=HV, K=K, BT=BT, BK=BK, VPP=vpp, DOT=dot, L2NORM=p.use_qk_l2norm, GATE=p.gate_in_op == "gdn",
        HAS_BIAS=p.dt_bias is not None, BETA=beta_mode, VARLEN=varlen,
        num_warps=config.inverse_warps, num_stages=config.inverse_stages,
    )


def launch_scores(p, q, k, total: int, tables, gcum, scores, rq, rk, dot, config) -> None:
    """Runs the scores kernel for ``total`` chunks after the inverse kernel (it reads G from
    ``gcum``): writes the causal scores into ``scores`` ``[B, T, HV, BT]`` and, with the l2norm,
    1 / |q| and 1 / |k| into ``rq``, ``rk`` ``[B, T, H]``."""
    cu, chunk_index = tables
    varlen = cu is not None
    dummy = gcum
    launcher(_scores_kernel, p.T, cdiv(p.T, BT))[(total, p.H)](
        q, k, gcum, scores, rq if rq is not None else dummy, rk if rk is not None else dummy,
        cu if varlen else dummy, chunk_index if varlen else dummy, p.T, cdiv(p.T, BT), p.scale,
        H=p.H, HV=p.HV, K=p.K, BT=BT, BK=max(16, next_pow2(p.K)), DOT=dot, L2NORM=p.use_qk_l2norm,
        VARLEN=varlen, num_warps=config.scores_warps, num_stages=1,
    )


def launch_gate_cumsum(p, total: int, tables, gcum) -> None:
    """Runs the plain rule's scalar-gate prologue for ``total`` chunks: G from ``p.g`` and / or
    ``p.g_gamma`` into ``gcum`` ``[B, T, HV]`` (zeros when neither is given)."""
    cu, chunk_index = tables
    varlen = cu is not None
    NT = cdiv(p.T, BT)
    launcher(_gate_cumsum_kernel, p.T, NT)[(total, p.HV)](
        p.g if p.g is not None else gcum, p.g_gamma if p.g_gamma is not None else gcum, gcum,
        cu if varlen else gcum, chunk_index if varlen else gcum, p.T, NT, HV=p.HV, BT=BT,
        HAS_G=p.g is not None, HAS_GAMMA=p.g_gamma is not None, VARLEN=varlen, num_warps=1, num_stages=1,
    )
