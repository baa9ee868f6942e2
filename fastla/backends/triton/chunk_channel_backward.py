"""Triton chunked backward with per-channel gates: KDA (the delta rule) and GLA (the plain rule,
``DELTA`` False: V_new = v, no beta nor A). Gradients of q, k, v, the log decay gk, beta and the
initial state, from dO and dht.

Inputs are the activated ones (``chunk_training.py``: the KDA gate, l2norm and beta sigmoid in
PyTorch): q, k ``[B, T, H, K]`` (GVA: value head ``j`` reads head ``j // (HV // H)``), v, dO
``[B, T, HV, V]``, gk (log decay, <= 0) ``[B, T, HV, K]`` and beta ``[B, T, HV]`` float32, h0 and
dht ``[N, HV, K, V]`` float32 (K-first).

Per chunk (G [BT, K] the in-chunk cumsum of gk, per-channel products
``(a * b)_ij = sum_c a_ic b_jc e^(G_ic - G_jc)``), the forward (chunk_prepare_kda.py, chunk_delta.py
with GK) is
    A = strict(diag(beta) (k * k)),  P = (I + A)^-1,  A_qk = scale causal(q * k),
    kg = k e^G,  qg = scale q e^G,  kd = k e^(G_last - G),  decay = e^(G_last),
    X = v - kg S,  V_new = P diag(beta) X,  O = qg S + A_qk V_new,  S' = diag(decay) S + kd^T V_new.
The backward:
1. the Triton KDA prologue again (P, A_qk, kg, qg, kd, decay) and G (``_channel_cumsum_kernel``);
   the chunk-start states S from the forward (or recomputed by the forward's scan);
2. chunk_delta_backward's reverse scan with GK: dS' per chunk, R = P^T dV_new, dh0;
3. ``_channel_value_grads_kernel``, grid ``(chunks, HV)``: dv = diag(beta) R, V_new (scratch),
   dA_qk = causal(dO V_new^T) and dA = -strict(R V_new^T) (scratch, ``[BT, BT]`` a token row),
   dbeta's rowsum(R * X);
4. ``_channel_key_grads_kernel``, grid ``(chunks, HV, K / BK)``: the state terms through qg, kg, kd
   and decay: d(qg) = dO S^T, d(kg) = -diag(beta) R S^T, d(kd) = V_new dS'^T, d(decay) = rowsum(S * dS'),
   into dq, dk and dG (G_last's share on the chunk's last token);
5. ``_channel_score_grads_kernel``, grid ``(chunks x 4, HV)`` (a program per row block): the
   score terms, for row block b (16 tokens) with r_b the G of its first row and column block c
   with e_c the G of its last row:
       dq_i = scale sum_j dA_qk_ij k_j e^(G_i - G_j),  (dk_row)_i = beta_i sum_j dA_ij k_j e^(G_i - G_j),
       (dk_col)_j = sum_i (scale dA_qk_ij q_i + beta_i dA_ij k_i) e^(G_i - G_j),
       dG_i += q_i dq_i + k_i (dk_row)_i,  dG_j -= k_j (dk_col)_j,  dbeta_i += sum_j dA_ij (k * k)_ij;
   blocks below the diagonal through products factored around r_b (rows) or e_c (columns), every
   factor e^(<= 0) for any decay; the diagonal blocks on fp32 products around their span's
   midpoint where that span is within 80 nats, else a row and a column at a time, exact; added to
   what step 4 stored (each entry read and written by one program);
6. dgk = the reverse in-chunk cumsum of dG (``_channel_cumsum_kernel``, REVERSE).
dq and dk are per value head (float32), summed per q/k head by qk_grads.input_grads.
Rows past a sequence's end take G_last as their G, and the reference rows are clamped to the last
valid one, so that no exponent of a masked entry is positive (inf times zero).
On by default for KDA, behind FASTLA_TRITON_BACKWARD=1 for GLA (``chunk_training.ENABLED``): on an
H100 KDA's bf16 cases pass at K = V = 16, 64 and 128 (docs/notes/chunk-backward.md), and the
value kernel's tiles (``value_block``) are those that passed the training fuzz's KDA K 64 V 32 and
GLA K = V = 64 cases there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastla.backends.triton import cdiv, chunk_delta_backward, chunk_prepare_kda, next_pow2
from fastla.backends.triton.chunk_index import BT, _chunk
from fastla.backends.triton.launch import launcher
from fastla.backends.triton.activations import BETA_GIVEN
from fastla.core import call_plan
from fastla.core.problem import Problem

# Launch shapes at K = V = 128 (sm_90 compiles, tests/backends/test_triton_sm90.py): the value
# kernel 163 registers (8 warps), the key kernel 136 (4 warps), the score kernel 244 at 4 warps
# (KDA, no stack). KDA's kernels timed on an H100 at kda/h64/1x8192 (benchmarks/backward_profile.py,
# docs/notes/chunk-backward.md): score 3.1 ms, key 2.0, reverse scan 1.3, value 1.2
VALUE_BLOCK_V = 32      # value columns per tile of _channel_value_grads_kernel (KDA past V = 32: value_block)
NARROW_VALUE_BLOCK_V = 16   # the same for KDA at V <= 32
KEY_BLOCK_K = 32        # key columns per program of _channel_key_grads_kernel
SCORE_BLOCK_K = 32      # key columns per step of _channel_score_grads_kernel
VALUE_WARPS = 8
KEY_WARPS = 4
SCORE_WARPS = 4
SCORE_STAGES = 1
# The score kernel's diagonal blocks: where a block's span (its first row's G less its last row's,
# the widest of the step's BK channels) is within DIAGONAL_SPAN_LIMIT nats, its four terms on
# [16, 16] x [16, BK] fp32 products around the span's midpoint (every factor within e^(+-40));
# wider blocks (and every block with this off) a row and a column at a time, exact for any decay.
# The bounded gate (lower_bound >= -5) spans at most 15 x 5 = 75. On an H100 at kda/h64/1x8192 the
# kernel took 12.1 ms with the loops alone (8 warps, 16 channels a step), 9.1 with the products,
# 3.3 with them at 4 warps and 32 channels, 3.1 with a chunk's four block programs next to each
# other in the grid (chunks x 4, HV), so that the q, k and G tiles each reads whole come from L2
# after the first (3296 us with the grid (chunks, HV, 4))
SCORE_DIAGONAL_PRODUCTS = True
DIAGONAL_SPAN_LIMIT = tl.constexpr(80.0)


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _channel_cumsum_kernel(
    x, out, cu_seqlens, chunk_index, T, NT,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, VARLEN: tl.constexpr,
    REVERSE: tl.constexpr,
):
    """Program (chunk, value head, BK channels): the in-chunk cumsum of x ``[B, T, HV, K]`` (fp32),
    from the chunk's first token, or (REVERSE) from its last one backwards."""
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_k = tl.program_id(2)
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * BT
    r = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m = (r < eos - t0)[:, None] & (o_k < K)[None, :]
    off = (t0 * HV + i_hv) * K + r[:, None] * (HV * K) + o_k[None, :]
    b_x = tl.load(x + off, mask=m, other=0.0).to(tl.float32)                                      # [BT, BK]
    b_y = tl.cumsum(b_x, 0, reverse=REVERSE)
    tl.store(out + off, b_y, mask=m)


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _channel_value_grads_kernel(
    kg, v, beta, p_in, h, dh_chunks, do, r_in, vn_out, dqk_out, dkk_out, dv, dbeta, cu_seqlens, chunk_index,
    T, NT,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, VARLEN: tl.constexpr,
    DELTA: tl.constexpr,
):
    """Program (chunk, value head), the value columns in tiles of BV: dv, V_new, dA_qk, dA and
    dbeta's rowsum(R * X) (DELTA False: dv = R, V_new = v, no dA nor dbeta)."""
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * BT
    base = t0 * HV + i_hv
    r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = r < eos - t0
    m_k = o_k < K
    lower_blocks = r[None, :] // 16 <= r[:, None] // 16                     # (P: zero above its diagonal)
    off_p = r[:, None] * (HV * BT) + r[None, :]                             # [BT, BT] in P
    off_pT = r[None, :] * (HV * BT) + r[:, None]                            # the scratch, transposed tiles
    if DELTA:
        b_kg = tl.load(kg + base * K + r[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                       other=0.0).to(DOT)                                                         # [BT, BK]
        b_beta = tl.load(beta + base + r * HV, mask=m_t, other=0.0)
        b_P = tl.load(p_in + base * BT + off_p, mask=m_t[:, None] & lower_blocks, other=0.0).to(DOT)      # [BT, BT]
    chunk_state = (i_c * HV + i_hv) * K * V
    # held transposed (row j, column i): tl.trans of a product's result (V_new) fed to another
    # product miscompiles on Hopper (GLUON.md)
    b_dAqkT = tl.zeros([BT, BT], dtype=tl.float32)      # (dO V_new^T)^T
    b_RVT = tl.zeros([BT, BT], dtype=tl.float32)        # (R V_new^T)^T
    b_db = tl.zeros([BT], dtype=tl.float32)             # rowsum(R * X)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        off_v = r[:, None] * (HV * V) + o_v[None, :]
        b_v = tl.load(v + base * V + off_v, mask=m_tv, other=0.0).to(tl.float32)                 # [BT, BV]
        b_do = tl.load(do + base * V + off_v, mask=m_tv, other=0.0).to(DOT)
        b_r = tl.load(r_in + base * V + off_v, mask=m_tv, other=0.0)
        if DELTA:
            b_S = tl.load(h + chunk_state + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                          other=0.0).to(DOT)                                                      # [BK, BV]
            b_x = b_v - tl.dot(b_kg, b_S)                                                         # X
            b_vn = tl.dot(b_P, (b_beta[:, None] * b_x).to(DOT))                                   # V_new
            b_dx = b_beta[:, None] * b_r
            tl.store(vn_out + base * V + off_v, b_vn.to(vn_out.dtype.element_ty), mask=m_tv)
        else:
            b_vn = b_v
            b_dx = b_r
        tl.store(dv + base * V + off_v, b_dx.to(dv.dtype.element_ty), mask=m_tv)
        b_vnd = b_vn.to(DOT)
        b_dAqkT += tl.dot(b_vnd, tl.trans(b_do))
        if DELTA:
            b_RVT += tl.dot(b_vnd, tl.trans(b_r.to(DOT)))
            b_db += tl.sum(b_r * b_x, 1)
    upper = r[:, None] <= r[None, :]                                        # j <= i
    tl.store(dqk_out + base * BT + off_pT, tl.where(upper, b_dAqkT, 0.0).to(dqk_out.dtype.element_ty),
             mask=m_t[None, :])
    if DELTA:
        tl.store(dkk_out + base * BT + off_pT, tl.where(r[:, None] < r[None, :], -b_RVT, 0.0).to(
            dkk_out.dtype.element_ty), mask=m_t[None, :])
        tl.store(dbeta + base + r * HV, b_db, mask=m_t)


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _channel_key_grads_kernel(
    q, k, beta, gcum, h, dh_chunks, do, r_in, vn_in, dq, dk, dG, cu_seqlens, chunk_index, T, NT, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, VARLEN: tl.constexpr,
    DELTA: tl.constexpr,
):
    """Program (chunk, value head, BK key columns): the state terms of dq, dk and dG there (stored;
    the score kernel adds its terms). ``vn_in`` is V_new (DELTA) or v."""
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_k = tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * BT
    base = t0 * HV + i_hv
    r = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = r < eos - t0
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    last = tl.minimum(eos - t0, BT) - 1
    if DELTA:
        b_beta = tl.load(beta + base + r * HV, mask=m_t, other=0.0)
    chunk_state = (i_c * HV + i_hv) * K * V
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)        # dO S^T
    b_dkg = tl.zeros([BT, BK], dtype=tl.float32)        # -diag(beta) R S^T
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)        # V_new dS'^T
    b_ddecay = tl.zeros([BK], dtype=tl.float32)         # rowsum(S * dS')
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        off_v = r[:, None] * (HV * V) + o_v[None, :]
        p_state_t = o_k[None, :] * V + o_v[:, None]                         # [BV, BK]: S^T
        m_ht = m_k[None, :] & m_v[:, None]
        b_St = tl.load(h + chunk_state + p_state_t, mask=m_ht, other=0.0).to(tl.float32)          # [BV, BK]
        b_dSt = tl.load(dh_chunks + chunk_state + p_state_t, mask=m_ht, other=0.0).to(tl.float32)
        b_do = tl.load(do + base * V + off_v, mask=m_tv, other=0.0).to(DOT)                       # [BT, BV]
        b_vn = tl.load(vn_in + base * V + off_v, mask=m_tv, other=0.0).to(DOT)
        b_dqg += tl.dot(b_do, b_St.to(DOT))
        b_dkd += tl.dot(b_vn, b_dSt.to(DOT))
        b_ddecay += tl.sum(b_St * b_dSt, 0)
        if DELTA:
            b_r = tl.load(r_in + base * V + off_v, mask=m_tv, other=0.0)
            b_dkg -= tl.dot((b_beta[:, None] * b_r).to(DOT), b_St.to(DOT))
    off_g = base * K + r[:, None] * (HV * K) + o_k[None, :]                 # [BT, BK] in G, dq, dk, dG
    b_G = tl.load(gcum + off_g, mask=m_tk, other=0.0)
    b_Gl = tl.load(gcum + base * K + last * (HV * K) + o_k, mask=m_k, other=0.0)                 # [BK]
    b_eG = tl.where(m_tk, tl.exp(b_G), 0.0)
    b_eD = tl.where(m_tk, tl.exp(b_Gl[None, :] - b_G), 0.0)
    qk_row0 = (t0 * H + i_h) * K
    off_kr = r[:, None] * (H * K) + o_k[None, :]
    b_q = tl.load(q + qk_row0 + off_kr, mask=m_tk, other=0.0).to(tl.float32)                      # [BT, BK]
    b_k = tl.load(k + qk_row0 + off_kr, mask=m_tk, other=0.0).to(tl.float32)
    b_dq = scale * b_eG * b_dqg
    b_dk = b_eD * b_dkd
    b_tkd = b_dk * b_k                                                      # d(kd) * kd
    b_dG = b_dq * b_q - b_tkd
    if DELTA:
        b_dkg = b_eG * b_dkg
        b_dk += b_dkg
        b_dG += b_dkg * b_k
    b_dGl = tl.sum(b_tkd, 0) + tl.exp(b_Gl) * b_ddecay                      # G_last: kd and decay
    b_dG += tl.where((r == last)[:, None], b_dGl[None, :], 0.0)
    off_kv = base * K + r[:, None] * (HV * K) + o_k[None, :]
    tl.store(dq + off_kv, b_dq, mask=m_tk)
    tl.store(dk + off_kv, b_dk, mask=m_tk)
    tl.store(dG + off_g, b_dG, mask=m_tk)


@triton.jit
def _g_rows(gcum, base, rows, last, o_k, m_k, HV: tl.constexpr, K: tl.constexpr):
    """G at ``rows`` ``[R, BK]`` (clamped to the chunk's last valid row: a row past a sequence's end
    takes G_last)."""
    rows = tl.minimum(rows, last)
    return tl.load(gcum + base * K + rows[:, None] * (HV * K) + o_k[None, :], mask=m_k[None, :], other=0.0)


@triton.jit
def _g_row(gcum, base, row, last, o_k, m_k, HV: tl.constexpr, K: tl.constexpr):
    """G at one row ``[BK]``, clamped as in _g_rows."""
    return tl.load(gcum + base * K + tl.minimum(row, last) * (HV * K) + o_k, mask=m_k, other=0.0)


@triton.jit
def _diagonal_terms(q, k, beta, gcum, dqk, dkk, base, qk_row0, b, rb, last, n_valid, o_k, m_k, b_Gb,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    DELTA: tl.constexpr):
    """Block b's diagonal [16, 16] terms over BK channels, a column or a row of the block at a time
    (``[16, BK]`` tiles; no [16, 16, BK] products nor reductions across threads): ``(D1, D2, D3,
    D4)`` [16, BK] with, for i, j in the block and E_ij = e^(G_i - G_j) (i >= j),
        D1_i = sum_j dA_qk_ij k_j E_ij,   D2_i = sum_j dA_ij k_j E_ij   (dA strict),
        D3_j = sum_i dA_qk_ij q_i E_ij,   D4_j = sum_i beta_i dA_ij k_i E_ij.
    Rows past the sequence's end read zeros and G_last (as _g_rows)."""
    rows = b * 16 + rb
    m_b = rows < n_valid
    b_d1 = tl.zeros([16, BK], dtype=tl.float32)
    b_d2 = tl.zeros([16, BK], dtype=tl.float32)
    b_d3 = tl.zeros([16, BK], dtype=tl.float32)
    b_d4 = tl.zeros([16, BK], dtype=tl.float32)
    for j in range(16):                     # (a loop: unrolled, its loads are hoisted and spill)
        row = b * 16 + j
        ok = row < n_valid
        b_kj = tl.load(k + qk_row0 + row * (H * K) + o_k, mask=m_k & ok, other=0.0).to(tl.float32)      # [BK]
        b_Gj = _g_row(gcum, base, row, last, o_k, m_k, HV, K)
        col_ij = base * BT + rows * (HV * BT) + row                         # column j of the block [16]
        below = rb >= j
        b_e = tl.where(below[:, None], tl.exp(tl.where(below[:, None], b_Gb - b_Gj[None, :], 0.0)), 0.0)  # [16, BK]
        b_ek = b_e * b_kj[None, :]
        b_d1 += tl.load(dqk + col_ij, mask=m_b, other=0.0)[:, None] * b_ek
        if DELTA:
            b_d2 += tl.load(dkk + col_ij, mask=m_b, other=0.0)[:, None] * b_ek
        # row j of the block against its columns: E_jc for c <= j
        b_qj = tl.load(q + qk_row0 + row * (H * K) + o_k, mask=m_k & ok, other=0.0).to(tl.float32)
        row_jc = base * BT + row * (HV * BT) + rows                         # row j of the block [16]
        above = rb <= j
        b_f = tl.where(above[:, None], tl.exp(tl.where(above[:, None], b_Gj[None, :] - b_Gb, 0.0)), 0.0)  # [16, BK]
        b_d3 += tl.load(dqk + row_jc, mask=ok, other=0.0)[:, None] * b_f * b_qj[None, :]
        if DELTA:
            b_bj = tl.load(beta + base + row * HV, mask=ok, other=0.0)
            b_d4 += (b_bj * tl.load(dkk + row_jc, mask=ok, other=0.0))[:, None] * b_f * b_kj[None, :]
    return b_d1, b_d2, b_d3, b_d4


@triton.jit
def _diagonal_products(b_aq_diag, b_a_diag, b_beta_b, b_qb, b_kb, b_Gb, b_first, b_lastrow, rb, DELTA: tl.constexpr):
    """_diagonal_terms' (D1, D2, D3, D4) on four [16, 16] x [16, BK] fp32 products (FMA; tf32's rounding
    breaks the cancellation of the i = j terms in dG), E_ij = e^(G_i - M)
    e^(M - G_j) factored around M, the midpoint of the block's first and last G (per channel): every
    factor within e^(+-span / 2), exact where the block's span is within DIAGONAL_SPAN_LIMIT."""
    b_mid = 0.5 * (b_first + b_lastrow)                                                     # [BK]
    b_down = tl.exp(b_Gb - b_mid[None, :])                                                 # e^(G_i - M) [16, BK]
    b_up = tl.exp(b_mid[None, :] - b_Gb)                                                   # e^(M - G_j) [16, BK]
    tri = rb[:, None] >= rb[None, :]
    b_aq = tl.where(tri, b_aq_diag, 0.0)                                                   # [16, 16]
    b_ku = b_kb * b_up
    b_d1 = b_down * tl.dot(b_aq, b_ku, input_precision="ieee")
    b_d3 = b_up * tl.dot(tl.trans(b_aq), b_qb * b_down, input_precision="ieee")
    if DELTA:
        b_a = tl.where(rb[:, None] > rb[None, :], b_a_diag, 0.0)
        b_d2 = b_down * tl.dot(b_a, b_ku, input_precision="ieee")
        b_d4 = b_up * tl.dot(tl.trans(b_beta_b[:, None] * b_a), b_kb * b_down, input_precision="ieee")
    else:
        b_d2 = tl.zeros_like(b_d1)
        b_d4 = tl.zeros_like(b_d1)
    return b_d1, b_d2, b_d3, b_d4


@triton.jit
def _diagonal(q, k, beta, gcum, dqk, dkk, base, qk_row0, b, rb, last, n_valid, o_k, m_k, b_aq_diag, b_a_diag,
              b_beta_b, b_qb, b_kb, b_Gb, b_first, b_lastrow, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
              BT: tl.constexpr, BK: tl.constexpr, DELTA: tl.constexpr, PRODUCTS: tl.constexpr):
    """Block b's diagonal terms (D1, D2, D3, D4): on products (_diagonal_products) where PRODUCTS and
    the block's span allow, else a row and a column at a time (_diagonal_terms)."""
    if PRODUCTS:
        if tl.max(b_first - b_lastrow, 0) <= DIAGONAL_SPAN_LIMIT:
            b_d1, b_d2, b_d3, b_d4 = _diagonal_products(b_aq_diag, b_a_diag, b_beta_b, b_qb, b_kb, b_Gb, b_first,
                                                        b_lastrow, rb, DELTA)
        else:
            b_d1, b_d2, b_d3, b_d4 = _diagonal_terms(q, k, beta, gcum, dqk, dkk, base, qk_row0, b, rb, last, n_valid,
                                                     o_k, m_k, b_Gb, H, HV, K, BT, BK, DELTA)
    else:
        b_d1, b_d2, b_d3, b_d4 = _diagonal_terms(q, k, beta, gcum, dqk, dkk, base, qk_row0, b, rb, last, n_valid,
                                                 o_k, m_k, b_Gb, H, HV, K, BT, BK, DELTA)
    return b_d1, b_d2, b_d3, b_d4


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _channel_score_grads_kernel(
    q, k, beta, gcum, dqk, dkk, dq, dk, dG, dbeta, cu_seqlens, chunk_index, T, NT, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, VARLEN: tl.constexpr, DELTA: tl.constexpr,
    DIAG_PRODUCTS: tl.constexpr,
):
    """Program (chunk, value head, row block b of 16 tokens): the block's score terms of dq, dk, dG
    (added to the key kernel's) and dbeta (added to the value kernel's), K in steps of BK; the
    diagonal block by _diagonal (DIAG_PRODUCTS: on products where its span allows)."""
    i_c = tl.program_id(0).to(tl.int64) // (BT // 16)        # (a chunk's four blocks side by side)
    b = tl.program_id(0) % (BT // 16)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * BT
    base = t0 * HV + i_hv
    n_valid = eos - t0
    last = tl.minimum(n_valid, BT) - 1
    qk_row0 = (t0 * H + i_h) * K
    r = tl.arange(0, BT)
    rb = tl.arange(0, 16)
    m_t = r < n_valid
    rows = b * 16 + rb                                                  # block b's rows / columns
    m_b = rows < n_valid
    # dA_qk and dA: block b's rows against every column [16, BT], its columns against every row
    # (transposed, [16, BT]), its diagonal block [16, 16]
    off_rows = base * BT + rows[:, None] * (HV * BT) + r[None, :]
    off_cols = base * BT + r[None, :] * (HV * BT) + rows[:, None]
    off_diag = base * BT + rows[:, None] * (HV * BT) + (b * 16 + rb)[None, :]
    b_aq_row = tl.load(dqk + off_rows, mask=m_b[:, None] & (r < b * 16)[None, :], other=0.0).to(tl.float32)
    b_aq_col = tl.load(dqk + off_cols, mask=(r >= b * 16 + 16)[None, :] & m_t[None, :], other=0.0).to(tl.float32)
    b_aq_diag = tl.load(dqk + off_diag, mask=m_b[:, None], other=0.0).to(tl.float32)            # [16, 16]
    if DELTA:
        b_beta = tl.load(beta + base + r * HV, mask=m_t, other=0.0)                             # [BT]
        b_beta_b = tl.load(beta + base + rows * HV, mask=m_b, other=0.0)                        # [16]
        b_a_row = tl.load(dkk + off_rows, mask=m_b[:, None] & (r < b * 16)[None, :], other=0.0).to(tl.float32)
        b_a_col = tl.load(dkk + off_cols, mask=(r >= b * 16 + 16)[None, :] & m_t[None, :],
                          other=0.0).to(tl.float32) * b_beta[None, :]   # beta_i dA_ij, [16 (j), BT (i)]
        b_a_diag = tl.load(dkk + off_diag, mask=m_b[:, None], other=0.0).to(tl.float32)
        b_db = tl.zeros([16], dtype=tl.float32)
    else:
        b_beta_b = tl.zeros([16], dtype=tl.float32)
        b_a_diag = b_aq_diag
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        off_kr = r[:, None] * (H * K) + o_k[None, :]
        b_q = tl.load(q + qk_row0 + off_kr, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)   # [BT, BK]
        b_k = tl.load(k + qk_row0 + off_kr, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_G = _g_rows(gcum, base, r, last, o_k, m_k, HV, K)                                    # [BT, BK]
        off_bk = rows[:, None] * (H * K) + o_k[None, :]
        m_bk = m_b[:, None] & m_k[None, :]
        b_qb = tl.load(q + qk_row0 + off_bk, mask=m_bk, other=0.0).to(tl.float32)             # [16, BK]
        b_kb = tl.load(k + qk_row0 + off_bk, mask=m_bk, other=0.0).to(tl.float32)
        b_Gb = _g_rows(gcum, base, rows, last, o_k, m_k, HV, K)                                # [16, BK]
        # rows of block b against the columns before it, around r_b (G of the block's first row)
        b_ref = _g_row(gcum, base, b * 16, last, o_k, m_k, HV, K)                              # [BK]
        b_left = tl.where((r < b * 16)[:, None], tl.exp(tl.where((r < b * 16)[:, None], b_ref[None, :] - b_G, 0.0)),
                          0.0)                                                                 # [BT, BK]
        b_up = tl.exp(b_Gb - b_ref[None, :])                                                   # [16, BK]
        b_kl = (b_k * b_left).to(DOT)
        b_dq = scale * b_up * tl.dot(b_aq_row.to(DOT), b_kl)
        # columns of block b against the rows after it, around e_b (G of the block's last row)
        b_end = _g_row(gcum, base, b * 16 + 15, last, o_k, m_k, HV, K)                         # [BK]
        after = (r >= b * 16 + 16)[:, None]
        b_right = tl.where(after, tl.exp(tl.where(after, b_G - b_end[None, :], 0.0)), 0.0)     # [BT, BK]
        b_down = tl.exp(b_end[None, :] - b_Gb)                                                 # [16, BK]
        b_dkc = scale * tl.dot(b_aq_col.to(DOT), (b_q * b_right).to(DOT))                    # [16, BK]
        if DELTA:
            b_dkc += tl.dot(b_a_col.to(DOT), (b_k * b_right).to(DOT))
        # the diagonal block
        b_d1, b_d2, b_d3, b_d4 = _diagonal(q, k, beta, gcum, dqk, dkk, base, qk_row0, b, rb, last, n_valid, o_k, m_k,
                                           b_aq_diag, b_a_diag, b_beta_b, b_qb, b_kb, b_Gb, b_ref, b_end,
                                           H, HV, K, BT, BK, DELTA, DIAG_PRODUCTS)
        b_dq += scale * b_d1
        b_dkc = b_down * b_dkc + scale * b_d3
        b_dG = b_qb * b_dq
        if DELTA:
            b_drow = b_up * tl.dot(b_a_row.to(DOT), b_kl) + b_d2                               # sum_j dA_ij k_j e^(..)
            b_db += tl.sum(b_kb * b_drow, 1)
            b_drow = b_beta_b[:, None] * b_drow
            b_dkc += b_d4
            b_dG += b_kb * b_drow
        else:
            b_drow = tl.zeros([16, BK], dtype=tl.float32)
        b_dG -= b_kb * b_dkc
        off_out = base * K + rows[:, None] * (HV * K) + o_k[None, :]
        tl.store(dq + off_out, tl.load(dq + off_out, mask=m_bk, other=0.0) + b_dq, mask=m_bk)
        tl.store(dk + off_out, tl.load(dk + off_out, mask=m_bk, other=0.0) + b_drow + b_dkc, mask=m_bk)
        tl.store(dG + off_out, tl.load(dG + off_out, mask=m_bk, other=0.0) + b_dG, mask=m_bk)
    if DELTA:
        tl.store(dbeta + base + rows * HV, tl.load(dbeta + base + rows * HV, mask=m_b, other=0.0) + b_db, mask=m_b)


def backward(p: Problem, do: torch.Tensor, dht: torch.Tensor | None, states: torch.Tensor | None = None):
    """Gradients ``(dq, dk [B, T, HV, K] per value head, dv [B, T, HV, V], dgk [B, T, HV, K], dbeta
    [B, T, HV] or None, dh0 [N, HV, K, V] or None)`` (float32; dv in v's dtype) of the chunked forward of ``p``
    (KDA, or GLA with ``p.delta`` False), whose q, k, v, gk (float32 log decay), beta (float32) and
    initial state (K-first, float32) are the activated ones; ``do``, ``dht`` and ``states`` as
    chunk_delta_backward.backward takes them."""
    c = chunk_delta_backward.call_of(p)
    p = c.p
    B, T, H, HV, K, V = p.B, p.T, p.H, p.HV, p.K, p.V
    dev, f32, total, op_dtype = p.device, torch.float32, c.total, c.op_dtype
    do = do.contiguous()

    # 1. the prologue's P, A_qk, kg, qg, kd, decay; G; the chunk-start states
    scores = call_plan.empty((B, T, HV, BT), op_dtype, dev)
    inverse = call_plan.empty((B, T, HV, BT), op_dtype, dev) if p.delta else scores
    qg, kd = (call_plan.empty((B, T, HV, K), op_dtype, dev) for _ in range(2))
    decay = call_plan.empty((max(total, 1), HV, K), f32, dev)
    kg = call_plan.empty((B, T, HV, K), op_dtype, dev) if p.delta else decay
    beta = p.beta if p.delta else decay
    gcum = call_plan.empty((B, T, HV, K), f32, dev)
    if total:
        chunk_prepare_kda.launch(p, p.q, p.k, beta, BETA_GIVEN, total, c.tables, inverse, scores, kg, kd, qg, decay,
                                 c.dot)
        _cumsum(c, p.gk, gcum, reverse=False)
    if states is None or states.dtype != c.state_dtype:
        states = chunk_delta_backward.chunk_states(c, qg, kg, kd, decay, beta, inverse, scores, decay, gk=True)

    # 2. the reverse scan (GK): dS' per chunk, R (GLA: dv), dh0
    dh_chunks, r_buf, dh0 = chunk_delta_backward.reverse_scan(c, qg, kg, kd, decay, beta, inverse, scores, decay,
                                                              do, dht, gk=True)

    # 3.-5. the gradients, chunk by chunk
    dq, dk, dG = (call_plan.empty((B, T, HV, K), f32, dev) for _ in range(3))
    dv = call_plan.empty((B, T, HV, V), p.v.dtype, dev)
    dbeta = call_plan.empty((B, T, HV), f32, dev) if p.delta else None
    dgk = call_plan.empty((B, T, HV, K), f32, dev)
    if total:
        v_new = call_plan.empty((B, T, HV, V), op_dtype, dev) if p.delta else p.v
        dqk = call_plan.empty((B, T, HV, BT), f32, dev)
        dkk = call_plan.empty((B, T, HV, BT), f32, dev) if p.delta else dqk
        varlen = c.cu is not None
        launcher(_channel_value_grads_kernel, T, c.NT)[(total, HV)](
            kg, p.v, beta, inverse, states, dh_chunks, do, r_buf, v_new, dqk, dkk, dv,
            dbeta if dbeta is not None else decay, *c.index(decay), T, c.NT, HV=HV, K=K, V=V, BT=BT, BK=c.BK,
            BV=value_block(p.delta, c.BVF), DOT=c.dot, VARLEN=varlen, DELTA=p.delta, num_warps=VALUE_WARPS,
            num_stages=1)
        BKS = min(KEY_BLOCK_K, c.BK)
        launcher(_channel_key_grads_kernel, T, c.NT)[(total, HV, cdiv(K, BKS))](
            p.q, p.k, beta, gcum, states, dh_chunks, do, r_buf, v_new, dq, dk, dG, *c.index(decay), T, c.NT, p.scale,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=BKS, BV=c.BV, DOT=c.dot, VARLEN=varlen, DELTA=p.delta,
            num_warps=KEY_WARPS, num_stages=1)
        launcher(_channel_score_grads_kernel, T, c.NT)[(total * (BT // 16), HV)](
            p.q, p.k, beta, gcum, dqk, dkk, dq, dk, dG, dbeta if dbeta is not None else decay, *c.index(decay),
            T, c.NT, p.scale, H=H, HV=HV, K=K, BT=BT, BK=min(SCORE_BLOCK_K, c.BK), DOT=c.dot, VARLEN=varlen,
            DELTA=p.delta, DIAG_PRODUCTS=SCORE_DIAGONAL_PRODUCTS,
            num_warps=SCORE_WARPS, num_stages=SCORE_STAGES)
        _cumsum(c, dG, dgk, reverse=True)
    return dq, dk, dv, dgk, dbeta, dh0


def value_block(delta: bool, BVF: int) -> int:
    """Value columns per tile of ``_channel_value_grads_kernel`` (BVF: V to a power of two). The
    plain rule (GLA) takes every column in one tile: at K = V = 64 its two 32-column tiles built with
    no products at all (LLVM unrolled the two trips; ptxas 12.8 and 12.9 then folded the
    zero-initialised, causally masked sums to zero: dA_qk zero, dq 0.39-1.0 from fp64 on an H100),
    and one 64-column tile passed there. KDA at V <= 32 takes 16-column tiles: its one 32-column
    tile faulted under CUDA 12.8's ptxas on an H100 (K 64, V 32: an illegal memory access; 12.9's
    build and 16-column tiles passed). Else VALUE_BLOCK_V (docs/notes/chunk-backward.md)."""
    if not delta:
        return BVF
    return min(NARROW_VALUE_BLOCK_V, BVF) if BVF <= 32 else min(VALUE_BLOCK_V, BVF)


def _cumsum(c, x: torch.Tensor, out: torch.Tensor, reverse: bool) -> None:
    """The in-chunk cumsum of ``x`` ``[B, T, HV, K]`` into ``out`` (``reverse``: from the end)."""
    p = c.p
    BKC = min(32, max(16, next_pow2(p.K)))
    launcher(_channel_cumsum_kernel, p.T, c.NT)[(c.total, p.HV, cdiv(p.K, BKC))](
        x, out, *c.index(out), p.T, c.NT, HV=p.HV, K=p.K, BT=BT, BK=BKC, VARLEN=c.cu is not None, REVERSE=reverse,
        num_warps=4, num_stages=1)
