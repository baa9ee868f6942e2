"""``_prepare_kernel_b16``: the GDN chunk prepare (kernel 1 of ``chunk_delta``) on 16-row blocks.

Same signature, launch, semantics and outputs as ``chunk_delta._prepare_kernel`` (grid
``(chunks, HV)``, one 64-token chunk of one value head; ``BLOCKED_INVERSE`` is accepted and
ignored), but no 64x64 tensor is ever formed. The chunk is cut into four 16-token blocks
``b = 0..3``; with ``A = strict_lower(beta_i (k_i . k_j) exp(G_i - G_j))``, ``I + A`` and
``P = (I + A)^-1`` are block lower triangular, and every block-sized quantity is held by block
diagonals, as ``[4, 16, 16]`` tensors batched over the row block ``b`` (at 4 warps each warp owns
one row block):

    X_s[b] = X_{b, b-s}   (s = 0..3; 0 for b < s)         [ X00                ]
                                                           [ X10 X11            ]
    e.g. X_0 = (X00, X11, X22, X33),                       [ X20 X21 X22        ]
         X_1 = (0, X10, X21, X32), X_3 = (0, 0, 0, X30)    [ X30 X31 X32 X33    ]

Per-token vectors are ``[4, 16]`` (token 16 b + i). Shifting by s blocks (``_shift``: slot b takes
slot b - s, a cross-warp ``tl.gather``) lines a block diagonal up with the next.

1. Keys, in column slices (SLICE, ``_keys``): 1 / |k|, the scan's decayed keys (STORE_KD) and the
   Gram diagonals D_s[b] = k_b k_{b-s}^T (batched tl.dot, DOT operands: k l2-normalised in fp32,
   then cast), the key rows of block b - s read directly from memory. Then
   A_0 = strict_lower(beta D_0 exp(G_i - G_j)),  A_s = beta D_s exp(G_i - G_j)  (s > 0).
2. P_0 = (I + A_0)^-1, the four diagonal blocks by forward substitution in fp32 at once
   (15 dependent row steps, reductions inside one warp).
3. The lower diagonals of P by block forward substitution, P_{b,c} = -P_bb sum_{c<=d<b} A_bd P_dc:
       P_1 = -P_0 (A_1 sh1(P_0))
       P_2 = -P_0 (A_2 sh2(P_0) + A_1 sh1(P_1))
       P_3 = -P_0 (A_3 sh3(P_0) + A_2 sh2(P_1) + A_1 sh1(P_2))
   batched tf32 16x16x16 products, exact (no series).
4. W = P diag(beta) (exp(G) k / |k|), U = P diag(beta) v: with Q_s = P_s diag(sh_s(beta)),
   W[b] = sum_s Q_s[b] (exp(G) k / |k|)_{b-s}, U likewise with v, in column slices (tf32
   dots, fp32 accumulation), the rows of block b - s read directly from memory.
Writes W, U (w/u dtype), G = cumsum(g) (fp32) and, with STORE_KD, exp(G_last - G) k / |k| (kd
dtype), like the original.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastla.backends.triton.recurrent import _softplus

# Column slice of the passes over k, v, w, u. Each pass is a runtime loop over slices, so one
# slice of loads is in flight at a time: 16 keeps the kernel at 128 registers (4 warps, sm_90, no
# spill: four CTAs per SM) at the price of more dependent load round trips; 32 halves those and
# needs 166 registers.
SLICE = tl.constexpr(16)


@triton.jit
def _tokens(g, beta, A_log, dt_bias, g_row0, n_left, i_hv, HV: tl.constexpr,
            GATE: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr):
    """Gate g (after the GDN transform when GATE) and beta of the chunk's tokens as [4, 16] (block,
    row: token 16 b + i) from element offset g_row0; 0 from token n_left on."""
    t = 16 * tl.arange(0, 4)[:, None] + tl.arange(0, 16)[None, :]                         # [4, 16]
    m_t = t < n_left
    b_g = tl.load(g + g_row0 + t * HV, mask=m_t, other=0.0).to(tl.float32)
    if GATE:
        if HAS_BIAS:
            b_g = b_g + tl.load(dt_bias + i_hv).to(tl.float32)
        b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * _softplus(b_g)
        b_g = tl.where(m_t, b_g, 0.0)
    b_beta = tl.load(beta + g_row0 + t * HV, mask=m_t, other=0.0).to(tl.float32)
    if BETA >= 2:
        b_beta = tl.where(m_t, tl.sigmoid(b_beta), 0.0)
    if BETA == 3:
        b_beta = 2.0 * b_beta
    return b_g, b_beta


@triton.jit
def _rows(x, row0, stride, n_left, j, S: tl.constexpr, D: tl.constexpr, BC: tl.constexpr):
    """Columns [j BC, (j + 1) BC) of the chunk's rows (row 0 at element offset row0, row stride
    `stride`, D columns) as [4, 16, BC] fp32, slot b holding block b - S: 0 for b < S, for rows
    from n_left on and for columns from D on."""
    b = tl.arange(0, 4)[:, None, None]
    t = 16 * (b - S) + tl.arange(0, 16)[None, :, None]                                   # [4, 16, 1]
    o = j * BC + tl.arange(0, BC)[None, None, :]                                         # [1, 1, BC]
    return tl.load(x + row0 + t * stride + o, mask=(b >= S) & (t < n_left) & (o < D), other=0.0).to(tl.float32)


@triton.jit
def _shift(X, S: tl.constexpr):
    """Slot b takes X[b - S] (0 for b < S), X [4, 16] or [4, 16, 16]: block-diagonal alignment."""
    if S == 0:
        Y = X
    else:
        b = tl.arange(0, 4)
        if len(X.shape) == 2:
            b = tl.broadcast_to(b[:, None], [4, X.shape[1]])
        else:
            b = tl.broadcast_to(b[:, None, None], [4, X.shape[1], X.shape[2]])
        Y = tl.where(b >= S, tl.gather(X, tl.maximum(b - S, 0), 0), 0.0)
    return Y


@triton.jit
def _keys(k, kd_out, k_row0, kd_row0, n_left, G, G_last,
          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
          L2NORM: tl.constexpr, STORE_KD: tl.constexpr):
    """Over the chunk's keys in column slices of at most SLICE: 1 / |k| (or 1) [4, 16]; with STORE_KD
    the scan's decayed unit keys exp(G_last - G) k / |k| at kd_out + kd_row0 (row stride HV * K);
    the Gram diagonals D_s[b] = k_b k_{b-s}^T of the unit keys (cast to DOT), s = 0..3, each
    [4, 16, 16] fp32. Runtime loops over the slices keep one slice of loads in flight."""
    BC: tl.constexpr = SLICE if BK > SLICE else BK
    rk = tl.full([4, 16], 1.0, tl.float32)
    if L2NORM:
        ss = tl.zeros([4, 16], tl.float32)
        for j in range(0, BK // BC):
            x = _rows(k, k_row0, H * K, n_left, j, 0, K, BC)                               # [4, 16, BC]
            ss += tl.sum(x * x, 2)
        rk = tl.rsqrt(ss + 1e-6)
    t = 16 * tl.arange(0, 4)[:, None, None] + tl.arange(0, 16)[None, :, None]             # [4, 16, 1]
    decay = tl.where(t < n_left, (rk * tl.exp(G_last - G))[:, :, None], 0.0)
    rk1 = _shift(rk, 1)[:, :, None]
    rk2 = _shift(rk, 2)[:, :, None]
    rk3 = _shift(rk, 3)[:, :, None]
    D0 = tl.zeros([4, 16, 16], tl.float32)
    D1 = D0
    D2 = D0
    D3 = D0
    for j in range(0, BK // BC):
        x = _rows(k, k_row0, H * K, n_left, j, 0, K, BC)                                   # [4, 16, BC]
        if STORE_KD:
            o = j * BC + tl.arange(0, BC)[None, None, :]
            tl.store(kd_out + kd_row0 + t * (HV * K) + o, (x * decay).to(kd_out.dtype.element_ty),
                     mask=(t < n_left) & (o < K))
        x = (x * rk[:, :, None]).to(DOT)
        D0 = tl.dot(x, tl.permute(x, (0, 2, 1)), D0)                                       # batched over b
        y = (_rows(k, k_row0, H * K, n_left, j, 1, K, BC) * rk1).to(DOT)
        D1 = tl.dot(x, tl.permute(y, (0, 2, 1)), D1)
        y = (_rows(k, k_row0, H * K, n_left, j, 2, K, BC) * rk2).to(DOT)
        D2 = tl.dot(x, tl.permute(y, (0, 2, 1)), D2)
        y = (_rows(k, k_row0, H * K, n_left, j, 3, K, BC) * rk3).to(DOT)
        D3 = tl.dot(x, tl.permute(y, (0, 2, 1)), D3)
    return rk, D0, D1, D2, D3


@triton.jit
def _a_diag(D, beta, G, S: tl.constexpr):
    """Block diagonal s of A from the Gram diagonal D [4, 16, 16]: beta_i D_ij exp(G_i - G_j), strictly
    lower inside the blocks for S = 0, 0 for b < S."""
    r = tl.arange(0, 16)
    if S == 0:
        lower = r[None, :, None] > r[None, None, :]                                      # [1, 16, 16]
        decay = tl.exp(tl.where(lower, G[:, :, None] - G[:, None, :], 0.0))
        A = tl.where(lower, beta[:, :, None] * D * decay, 0.0)
    else:
        b = tl.arange(0, 4)[:, None, None]
        A = tl.where(b >= S, beta[:, :, None] * D * tl.exp(G[:, :, None] - _shift(G, S)[:, None, :]), 0.0)
    return A


@triton.jit
def _unit_lower_inverse16x4(A):
    """(I + A_b)^-1 for four strictly lower-triangular [16, 16] fp32 blocks A [4, 16, 16] by forward
    substitution, all four at once: row i of P_b is e_i - sum_{j<i} A_b[i, j] P_b[j] (rows j < i
    already final). The reductions run along the rows of one block (inside one warp at 4 warps)."""
    r = tl.arange(0, 16)
    rows = r[None, :, None]                                                                # [1, 16, 1]
    P = tl.where(rows == r[None, None, :], 1.0, 0.0 * A)     # I, built from A to take A's layout (one block per warp)
    for i in range(1, 16):
        sel = rows == i
        a = tl.sum(tl.where(sel, A, 0.0), 1)                                               # A_b[i, :] [4, 16]
        P = tl.where(sel, P - tl.sum(a[:, :, None] * P, 1)[:, None, :], P)
    return P


@triton.jit
def _bmm(a, b, acc):
    """Batched [4, 16, 16] x [4, 16, N] + acc on tensor cores (tf32 operands, fp32 accumulation)."""
    return tl.dot(a, b, acc, input_precision="tf32")


@triton.jit
def _apply(Q0, Q1, Q2, Q3, e, src, src_row0, src_stride, dst, dst_row0, dst_stride, n_left,
           D: tl.constexpr, BD: tl.constexpr, SCALE: tl.constexpr):
    """Y[b] = sum_s Q_s[b] (e X)_{b-s} for the chunk's rows X at src + src_row0 (row stride src_stride,
    D columns; row scales e [4, 16] only when SCALE), stored at dst + dst_row0 (row stride dst_stride)
    in dst's dtype; column slices of at most SLICE, tf32 dots with fp32 accumulation."""
    BC: tl.constexpr = SLICE if BD > SLICE else BD
    t = 16 * tl.arange(0, 4)[:, None, None] + tl.arange(0, 16)[None, :, None]             # [4, 16, 1]
    e0 = e[:, :, None]
    e1 = _shift(e, 1)[:, :, None]
    e2 = _shift(e, 2)[:, :, None]
    e3 = _shift(e, 3)[:, :, None]
    for j in range(0, BD // BC):
        x = _rows(src, src_row0, src_stride, n_left, j, 0, D, BC)                         # [4, 16, BC]
        if SCALE:
            x = x * e0
        acc = _bmm(Q0, x, tl.zeros([4, 16, BC], tl.float32))
        x = _rows(src, src_row0, src_stride, n_left, j, 1, D, BC)
        if SCALE:
            x = x * e1
        acc = _bmm(Q1, x, acc)
        x = _rows(src, src_row0, src_stride, n_left, j, 2, D, BC)
        if SCALE:
            x = x * e2
        acc = _bmm(Q2, x, acc)
        x = _rows(src, src_row0, src_stride, n_left, j, 3, D, BC)
        if SCALE:
            x = x * e3
        acc = _bmm(Q3, x, acc)
        o = j * BC + tl.arange(0, BC)[None, None, :]
        tl.store(dst + dst_row0 + t * dst_stride + o, acc.to(dst.dtype.element_ty), mask=(t < n_left) & (o < D))


@triton.jit
def _prepare_kernel_b16(
    k, v, g, beta, A_log, dt_bias, w, u, gcum, kd, cu_seqlens, chunk_index, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, DOT: tl.constexpr,
    L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
    VARLEN: tl.constexpr, BLOCKED_INVERSE: tl.constexpr, STORE_KD: tl.constexpr,
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

    # ---- per token [4, 16]: gate, beta, G = cumsum(g) over the chunk, G at the last token
    g_t, beta_t = _tokens(g, beta, A_log, dt_bias, base, n_left, i_hv, HV, GATE, HAS_BIAS, BETA)
    blk = tl.sum(g_t, 1)                                                                  # [4]
    G = tl.cumsum(g_t, 1) + (tl.cumsum(blk, 0) - blk)[:, None]                            # [4, 16]
    t = 16 * tl.arange(0, 4)[:, None] + tl.arange(0, 16)[None, :]
    tl.store(gcum + base + t * HV, G, mask=t < n_left)
    G_last = tl.sum(tl.sum(tl.where(t == tl.minimum(n_left, BT) - 1, G, 0.0), 1), 0)

    # ---- keys: 1 / |k|, kd, Gram diagonals -> the block diagonals A_s of A [4, 16, 16]
    rk, D0, D1, D2, D3 = _keys(k, kd, k_base, base * K, n_left, G, G_last, H, HV, K, BK, DOT, L2NORM, STORE_KD)
    A0 = _a_diag(D0, beta_t, G, 0)
    A1 = _a_diag(D1, beta_t, G, 1)
    A2 = _a_diag(D2, beta_t, G, 2)
    A3 = _a_diag(D3, beta_t, G, 3)

    # ---- P = (I + A)^-1 by block diagonals: P_0 by forward substitution, then P_1, P_2, P_3
    P0 = _unit_lower_inverse16x4(A0)
    Z = tl.zeros([4, 16, 16], tl.float32)
    P1 = -_bmm(P0, _bmm(A1, _shift(P0, 1), Z), Z)
    P2 = -_bmm(P0, _bmm(A1, _shift(P1, 1), _bmm(A2, _shift(P0, 2), Z)), Z)
    P3 = -_bmm(P0, _bmm(A1, _shift(P2, 1), _bmm(A2, _shift(P1, 2), _bmm(A3, _shift(P0, 3), Z))), Z)

    # ---- W = P diag(beta) (exp(G) k / |k|), U = P diag(beta) v
    Q0 = P0 * beta_t[:, None, :]
    Q1 = P1 * _shift(beta_t, 1)[:, None, :]
    Q2 = P2 * _shift(beta_t, 2)[:, None, :]
    Q3 = P3 * _shift(beta_t, 3)[:, None, :]
    _apply(Q0, Q1, Q2, Q3, rk * tl.exp(G), k, k_base, H * K, w, base * K, HV * K, n_left, K, BK, True)
    _apply(Q0, Q1, Q2, Q3, rk, v, base * V, HV * V, u, base * V, HV * V, n_left, V, BVF, False)
