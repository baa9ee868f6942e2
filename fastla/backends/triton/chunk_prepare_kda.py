"""Token-parallel prologue of the KDA chunked forward (Triton tier): per 64-token chunk and value
head, the per-channel gate's cumsum, the WY factor P, the causal scores and the gated keys and
queries that the scan (chunk_delta.py, ``GK``) multiplies with the state.

``_kda_prepare_kernel``, grid ``(chunks, HV)``, 4 warps. With G [BT, K] the in-chunk cumsum of
the log decay (the KDA gate computed here when it is in the op), unit keys and queries when the
l2norm is in the op, and per-channel products ``(a * b)_ij = sum_c a_ic b_jc e^(G_ic - G_jc)``:
    A   = strict_lower(diag(beta) (k * k)),  P = (I + A)^-1                  [BT, BT]
    Aqk = scale lower(q * k)                                                 [BT, BT]
    kg = k e^G,   kd = k e^(G_last - G),   qg = scale q e^G                  [BT, K]
    decay = e^(G_last)                                                       [K]
so the scan's chunk step is V_new = P diag(beta) (v - kg S), O = qg S + Aqk V_new,
S = diag(decay) S + kd^T V_new (the GDN step with per-channel gates).

The per-channel products go through tensor cores in 16-token blocks b, with c_b the cumsum at
the end of block b (c_-1 = 0, G decreasing):
- below the diagonal (block c < b): (k_b e^(G_b - c_(b-1))) (k_c e^(c_c - G_c) e^(c_(b-1) - c_c))^T,
  every exponent <= 0, so no factor overflows for any decay;
- on the diagonal: the factors k e^(G - m) and k e^(m - G) around the block's mid value
  m = (c_(b-1) + c_b) / 2 lie within e^(+-span / 2), span = max over channels of c_(b-1) - c_b;
  that form is used when span <= SPAN_LIMIT (always with safe_gate: span <= 16 x 5), else the
  block is summed pair by pair with exact exponentials (unbounded gates under strong decay).
Only two exponentials per gate element. P follows as in the GDN prologue (chunk_prepare.py):
the four diagonal blocks by forward substitution, the six lower blocks by block substitution.

Writes P and Aqk ``[B, T, HV, BT]`` (whole rows, zero above the block diagonal), kg, kd, qg
``[B, T, HV, K]`` in the product dtype and decay ``[chunks, HV, K]`` fp32. Budget (sm_90,
K = 128, tests/backends/test_triton_sm90.py): under 255 registers at 4 warps, no spill.
Traffic per token and value head (bf16, K = 128): 768 bytes of gated keys and queries and
256 of P and Aqk written; q and k read once per value head (from L2 within a GVA group).
Measurements: docs/notes/kda-prefill.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastla.backends.triton import next_pow2
from fastla.backends.triton.chunk_index import BT, _chunk
from fastla.backends.triton.chunk_prepare import _activate_beta
from fastla.backends.triton.launch import launcher
from fastla.backends.triton.recurrent import GATE_KDA, GATE_KDA_BOUNDED, GATE_NONE, _softplus

# largest in-block decay span (natural log) of the tensor-core diagonal form: its factors stay
# within e^(+-40), far inside the bf16 / fp32 range for any key magnitude below 1e20
SPAN_LIMIT = tl.constexpr(80.0)


@triton.jit
def _log_decay(g, A_log, dt_bias, lower_bound, base, n_left, i_hv, o_k, BT: tl.constexpr, HV: tl.constexpr,
               K: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The chunk's log decay [BT, BK] in channels o_k (the KDA gate when GATE is in the op); 0 off
    the chunk and off the K channels, so every cumsum holds G_last past the chunk's end."""
    r = tl.arange(0, BT)
    m = (r < n_left)[:, None] & (o_k < K)[None, :]
    x = tl.load(g + base + r[:, None] * (HV * K) + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    if GATE != 0:
        if HAS_BIAS:
            x = x + tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)[None, :]
        if HAS_A:
            a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        else:
            a = 1.0
        if GATE == 2:
            x = -a * _softplus(x)
        else:
            x = lower_bound * tl.sigmoid(a * x)
        x = tl.where(m, x, 0.0)
    return x


@triton.jit
def _rows(x, BT: tl.constexpr, BK: tl.constexpr):
    """[4, 16, BK] -> [BT, BK] (the chunk's rows in order)."""
    return tl.reshape(x, (BT, BK))


@triton.jit
def _row_of(x, j):
    """Row j of each 16-token block of x [4, 16, BK] -> [4, BK]."""
    sel = tl.arange(0, 16)[None, :, None] == j
    return tl.sum(tl.where(sel, x, 0.0), 1)


@triton.jit
def _diagonal_exact(k3, q3, W, BT: tl.constexpr):
    """The diagonal blocks' per-channel products k_i . k_j and q_i . k_j (j <= i in one block)
    pair by pair, e^(W_i - W_j) <= 1 exactly (W: the within-block cumsum [4, 16, BK]); [BT, BT]
    with only the block-diagonal entries set."""
    r16 = tl.arange(0, 16)
    r = tl.arange(0, BT)
    a = tl.zeros([BT, BT], dtype=tl.float32)
    s = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(16):
        W_j = _row_of(W, j)                                                                    # [4, BK]
        k_j = _row_of(k3, j)
        keep = (r16 >= j)[None, :, None]
        e = tl.where(keep, tl.exp(tl.where(keep, W - W_j[:, None, :], 0.0)), 0.0)              # [4, 16, BK]
        a_j = tl.reshape(tl.sum(k3 * e * k_j[:, None, :], 2), (BT,))                         # [BT]
        s_j = tl.reshape(tl.sum(q3 * e * k_j[:, None, :], 2), (BT,))
        col = r[None, :] == (r // 16 * 16 + j)[:, None]
        a = tl.where(col, a_j[:, None], a)
        s = tl.where(col, s_j[:, None], s)
    return a, s


@triton.jit
def _block_diag_inverse(A, BT: tl.constexpr):
    """(I + D)^-1 of the four diagonal [16, 16] blocks D of the strictly lower A [BT, BT], by forward
    substitution on all four at once (row i of P_b is e_i - sum_(j<i) A_b[i, j] P_b[j, :]);
    returned as the block-diagonal [BT, BT] matrix."""
    b4 = tl.arange(0, 4)
    same = (b4[:, None, None, None] == b4[None, None, :, None])                                # [4, 1, 4, 1]
    D = tl.sum(tl.where(same, tl.reshape(A, (4, 16, 4, 16)), 0.0), 2)                        # [4, 16, 16]
    Dt = tl.permute(D, (0, 2, 1))                                                              # A_b^T
    r = tl.arange(0, 16)
    P = tl.broadcast_to(tl.where(r[:, None] == r[None, :], 1.0, 0.0)[None, :, :], (4, 16, 16))
    for i in range(1, 16):
        a_i = tl.sum(tl.where((r == i)[None, None, :], Dt, 0.0), 2)                           # [4, 16]: A_b[i, :]
        upd = tl.sum(a_i[:, :, None] * P, 1)                                                   # [4, 16]
        P = tl.where((r == i)[None, :, None], P - upd[:, None, :], P)
    full = tl.where(same, tl.broadcast_to(P[:, :, None, :], (4, 16, 4, 16)), 0.0)
    return tl.reshape(full, (BT, BT))


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _kda_prepare_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, scale, p_out, a_out, kg, kd, qg, decay,
    cu_seqlens, chunk_index, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
    HAS_BIAS: tl.constexpr, BETA: tl.constexpr, VARLEN: tl.constexpr,
):
    tl.static_assert(BT == 64, "four 16-token blocks")
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)                                                 # GVA: the q/k head
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * BT
    n_left = eos - t0                                                       # tokens of the chunk from t0, >= 1
    r = tl.arange(0, BT)
    m_t = r < n_left
    qk_row0 = (t0 * H + i_h) * K
    beta_base = t0 * HV + i_hv                                              # chunk row 0 in beta, P, Aqk
    gate_base = beta_base * K                                               # chunk row 0 in g, kg, kd, qg
    off_qk = qk_row0 + r[:, None] * (H * K)                                 # [BT, 1]
    off_g = gate_base + r[:, None] * (HV * K)

    # 1 / |q|, 1 / |k| per row (over all K channels), scale folded into the queries
    rk = tl.full([BT], 1.0, tl.float32)
    rq = tl.full([BT], 1.0, tl.float32)
    if L2NORM:
        sk = tl.zeros([BT], dtype=tl.float32)
        sq = tl.zeros([BT], dtype=tl.float32)
        for ks in range(0, tl.cdiv(K, BK)):
            o_k = ks * BK + tl.arange(0, BK)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_k = tl.load(k + off_qk + o_k[None, :], mask=m, other=0.0).to(tl.float32)
            b_q = tl.load(q + off_qk + o_k[None, :], mask=m, other=0.0).to(tl.float32)
            sk += tl.sum(b_k * b_k, 1)
            sq += tl.sum(b_q * b_q, 1)
        rk = tl.rsqrt(sk + 1e-6)
        rq = tl.rsqrt(sq + 1e-6)
    rq = rq * scale

    blk = r // 16
    b4 = tl.arange(0, 4)
    A = tl.zeros([BT, BT], dtype=tl.float32)                                # sum over channels, beta later
    S = tl.zeros([BT, BT], dtype=tl.float32)
    for ks in range(0, tl.cdiv(K, BK)):
        o_k = ks * BK + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        x = tl.reshape(_log_decay(g, A_log, dt_bias, lower_bound, gate_base, n_left, i_hv, o_k, BT, HV, K, GATE,
                                  HAS_A, HAS_BIAS), (4, 16, BK))
        W = tl.cumsum(x, 1)                                                 # within-block cumsum [4, 16, BK]
        Sb = tl.sum(x, 1)                                                   # block sums [4, BK], <= 0
        c_end = tl.cumsum(Sb, 0)                                            # G at each block's end
        c_prev = c_end - Sb                                                 # G before each block
        G_last = tl.sum(Sb, 0)                                              # [BK]
        k3 = tl.reshape(tl.load(k + off_qk + o_k[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None],
                        (4, 16, BK))
        q3 = tl.reshape(tl.load(q + off_qk + o_k[None, :], mask=m, other=0.0).to(tl.float32) * rq[:, None],
                        (4, 16, BK))
        E = tl.exp(W)                                                       # e^(G - c_prev) <= 1
        L3 = k3 * E
        Q3 = q3 * E
        F3 = k3 * tl.exp(Sb[:, None, :] - W)                                # k e^(c_end - G), <= 1
        up = tl.exp(c_prev)[:, None, :]
        tl.store(kg + off_g + o_k[None, :], _rows(L3 * up, BT, BK).to(kg.dtype.element_ty), mask=m)
        tl.store(qg + off_g + o_k[None, :], _rows(Q3 * up, BT, BK).to(qg.dtype.element_ty), mask=m)
        kd3 = F3 * tl.exp(G_last[None, :] - c_end)[:, None, :]              # k e^(G_last - G)
        tl.store(kd + off_g + o_k[None, :], _rows(kd3, BT, BK).to(kd.dtype.element_ty), mask=m)
        tl.store(decay + (i_c * HV + i_hv) * K + o_k, tl.exp(G_last), mask=o_k < K)

        L = _rows(L3, BT, BK).to(DOT)
        Q = _rows(Q3, BT, BK).to(DOT)
        for b in tl.static_range(1, 4):                                     # row block b against blocks < b
            cp_b = tl.sum(tl.where(b4[:, None] == b, c_prev, 0.0), 0)                        # [BK]
            before = (b4 < b)[:, None]
            f = tl.where(before, tl.exp(tl.where(before, cp_b[None, :] - c_end, 0.0)), 0.0)  # [4, BK], <= 1
            R = tl.trans(_rows(F3 * f[:, None, :], BT, BK).to(DOT))                           # [BK, BT]
            rows_b = (blk == b)[:, None]
            A += tl.where(rows_b, tl.dot(L, R), 0.0)
            S += tl.where(rows_b, tl.dot(Q, R), 0.0)
        span = tl.max(tl.max(-Sb, 1), 0)
        if span <= SPAN_LIMIT:
            h = tl.exp(-0.5 * Sb)[:, None, :]                                # e^(span_b / 2) per channel
            R = tl.trans(_rows(F3 * h, BT, BK).to(DOT))                                        # k e^(m - G)
            a_d = tl.dot(_rows(L3 * h, BT, BK).to(DOT), R)                                     # k e^(G - m)
            s_d = tl.dot(_rows(Q3 * h, BT, BK).to(DOT), R)
        else:
            a_d, s_d = _diagonal_exact(k3, q3, W, BT)
        diag = blk[:, None] == blk[None, :]
        A += tl.where(diag, a_d, 0.0)
        S += tl.where(diag, s_d, 0.0)

    b_beta = _activate_beta(tl.load(beta + beta_base + r * HV, mask=m_t, other=0.0), m_t, BETA)
    A = tl.where(r[:, None] > r[None, :], b_beta[:, None] * A, 0.0)
    S = tl.where(r[:, None] >= r[None, :], S, 0.0)

    # P = (I + A)^-1 = (I + M)^-1 D^-1 with D = I + A's diagonal blocks and M = D^-1 (A - diag blocks),
    # strictly block lower (M^4 = 0): (I + M)^-1 = I - M (I - M (I - M)), tf32 products
    Dinv = _block_diag_inverse(A, BT)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    M = tl.dot(Dinv, tl.where(blk[:, None] > blk[None, :], A, 0.0), input_precision="tf32")
    Y = eye - M
    Y = eye - tl.dot(M, Y, input_precision="tf32")
    Y = eye - tl.dot(M, Y, input_precision="tf32")
    P = tl.dot(Y, Dinv, input_precision="tf32")
    off_p = beta_base * BT + r[:, None] * (HV * BT) + r[None, :]
    tl.store(p_out + off_p, P.to(p_out.dtype.element_ty), mask=m_t[:, None])
    tl.store(a_out + off_p, S.to(a_out.dtype.element_ty), mask=m_t[:, None])


def gate_mode(p) -> int:
    """The recurrent kernel's numbering of the gate computed in the op (none, KDA, bounded KDA)."""
    if p.gate_in_op != "kda":
        return GATE_NONE
    return GATE_KDA if p.lower_bound is None else GATE_KDA_BOUNDED


def launch(p, q, k, beta, beta_mode: int, total: int, tables, inverse, scores, kg, kd, qg, decay, dot,
           warps: int = 8) -> None:
    """Runs the prologue over ``total`` chunks (``tables`` = (cu_seqlens, chunk index) or Nones):
    writes P into ``inverse``, Aqk into ``scores`` ``[B, T, HV, BT]``, the gated keys and queries
    into ``kg``, ``kd``, ``qg`` ``[B, T, HV, K]`` and e^(G_last) into ``decay`` ``[total, HV, K]``."""
    cu, chunk_index = tables
    varlen = cu is not None
    dummy = decay
    NT = -(-p.T // BT)
    launcher(_kda_prepare_kernel, p.T, NT)[(total, p.HV)](
        q, k, p.gk, beta, p.A_log if p.A_log is not None else dummy, p.dt_bias if p.dt_bias is not None else dummy,
        float(p.lower_bound) if p.lower_bound is not None else 0.0, p.scale,
        inverse, scores, kg, kd, qg, decay, cu if varlen else dummy, chunk_index if varlen else dummy, p.T, NT,
        H=p.H, HV=p.HV, K=p.K, BT=BT, BK=16, DOT=dot, L2NORM=p.use_qk_l2norm,
        GATE=gate_mode(p), HAS_A=p.A_log is not None, HAS_BIAS=p.dt_bias is not None, BETA=beta_mode,
        VARLEN=varlen, num_warps=warps, num_stages=1,
    )
