"""Token-parallel prologue of the KDA chunked forward (Triton tier): per 64-token chunk and value
head, the per-channel gate's cumsum, the WY factor P, the causal scores and the gated keys and
queries that the scan (the Triton one in chunk_delta.py and the Gluon one in
backends/gluon/chunk_delta_sm90.py, both ``GK``) multiplies with the state.

``_kda_prepare_kernel``, grid ``(chunks, HV)``, launched twice (SCORES False: A, P, kg, kd,
decay; SCORES True: Aqk, qg), one warp (no barriers: the cumsums and reductions stay within the
warp), K in slices of BK = 16 channels (fp32 [16, 16] block accumulators across slices, mma.sync
products). With G [BT, K] the in-chunk cumsum of the log decay (the KDA gate computed here when it
is in the op), unit keys and queries when the l2norm is in the op, and per-channel products
``(a * b)_ij = sum_c a_ic b_jc e^(G_ic - G_jc)``:
    A   = strict_lower(diag(beta) (k * k)),  P = (I + A)^-1                  [BT, BT]
    Aqk = scale lower(q * k)                                                 [BT, BT]
    kg = k e^G,   kd = k e^(G_last - G),   qg = scale q e^G                  [BT, K]
    decay = e^(G_last)                                                       [K]
so the scan's chunk step is V_new = P diag(beta) (v - kg S), O = qg S + Aqk V_new,
S = diag(decay) S + kd^T V_new (the GDN step with per-channel gates).

The per-channel products go through tensor cores in 16-token blocks b, each taken on its own:
L_b the gate's cumsum within the block, s_b = L_b,15 its span (<= 0), c_b = s_0 + .. + s_b the
cumsum at the block's end, X_b = left e^(L_b) and F_b = k e^(s_b - L_b) (both <= 1):
- below the diagonal (block c < b): X_b (F_c e^(c_(b-1) - c_c))^T, the factor 1 for c = b - 1
  and a product of the blocks' e^(s) in between otherwise: every factor <= 1 for any decay;
- on the diagonal: (X_b h) (F_b h)^T with h = e^(-s_b / 2), i.e. around the block's mid value,
  factors within e^(+-span / 2), used when the span is <= SPAN_LIMIT (always with safe_gate:
  span <= 16 x 5), else the block is summed pair by pair with exact exponentials (unbounded gates
  under strong decay);
- kg, qg = X_b e^(c_(b-1)), kd = F_b e^(c_3 - c_b), decay = e^(c_3), from the four e^(s_b).
Work is in log2 units (tl.exp2 is one MUFU.EX2; tl.exp adds four instructions): per gate element
and launch the gate's transform, X and F. Without bounded spans (EXACT) the pairwise path is
compiled in. P follows as in the GDN prologue (chunk_prepare.py): the four diagonal blocks by
forward substitution, the six lower blocks by block substitution.

Writes P and Aqk ``[B, T, HV, BT]`` (whole rows, zero above the block diagonal), kg, kd, qg
``[B, T, HV, K]`` in the product dtype and decay ``[chunks, HV, K]`` fp32. Budget (sm_90,
K = 128, tests/backends/test_triton_sm90.py): 254 / 247 registers at one warp and BK 16 with the
gate in the op, no spill (each block's gated keys are stored as soon as it is done, which ends
X_b's life early); with a precomputed bf16 gate and the exact diagonal, 255 and 8 bytes of spill
in both launches (not timed separately).
Latency-bound: ~1.0 ms for both launches at 1x8k H64 (docs/notes/kda-prefill.md).
Traffic per token and value head (bf16, K = 128): 768 bytes of gated keys and queries and
256 of P and Aqk written; q and k read once per value head (from L2 within a GVA group).
Measurements: docs/notes/kda-prefill.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastla.backends.triton import next_pow2
from fastla.backends.triton.activations import GATE_KDA, GATE_KDA_BOUNDED, GATE_NONE, LOG2E, log2_decay
from fastla.backends.triton.chunk_index import BT, _chunk
from fastla.backends.triton.chunk_prepare import (
    _activate_beta, _diag_inverses_rows, _key_block, _lower_inverse, _lower_merge, _store_lower,
)
from fastla.backends.triton.launch import launcher

# the kernel works in log2 units (tl.exp2 is one MUFU.EX2; tl.exp adds four instructions: LOG2E and
# log2_decay in activations.py). The largest in-block decay span of the tensor-core diagonal
# form, 80 nats in log2 units: its factors stay within e^(+-40), far inside the bf16 / fp32 range
# for any key magnitude below 1e20
SPAN_LIMIT = tl.constexpr(80.0 * 1.4426950408889634)


@triton.jit
def _log_decay(g, A_log, dt_bias, lower_bound, base, t, n_left, i_hv, o_k, HV: tl.constexpr, K: tl.constexpr,
               GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Log2 decay of the chunk's rows t in channels o_k [len(t), BK] (the KDA gate when GATE is in
    the op, times log2(e)); 0 off the chunk and off the K channels, so a cumsum holds G_last past
    the chunk's end."""
    m = (t < n_left)[:, None] & (o_k < K)[None, :]
    x = tl.load(g + base + t[:, None] * (HV * K) + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    if GATE != 0:
        if HAS_BIAS:
            x = x + tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)[None, :]
        if HAS_A:
            a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        else:
            a = 1.0
        return tl.where(m, log2_decay(x, a, lower_bound, GATE == 3), 0.0)      # (3: GATE_KDA_BOUNDED)
    return x * LOG2E


@triton.jit
def _store_rows(out, base, x, blk: tl.constexpr, n_left, o_k, HV: tl.constexpr, K: tl.constexpr):
    """Rows 16 blk .. 16 blk + 15 of a chunk's [BT, K] tensor at out + base (row stride HV K)."""
    t = blk * 16 + tl.arange(0, 16)
    tl.store(out + base + t[:, None] * (HV * K) + o_k[None, :], x.to(out.dtype.element_ty),
             mask=(t < n_left)[:, None] & (o_k < K)[None, :])


@triton.jit
def _row_norms(x, base, blk: tl.constexpr, n_left, K: tl.constexpr, BK: tl.constexpr, stride):
    """1 / |x_t| of the block's 16 rows over all K channels [16] (FLA's eps)."""
    acc = tl.zeros([16], dtype=tl.float32)
    for ks in range(0, tl.cdiv(K, BK)):
        b = _key_block(x, base, blk, n_left, ks * BK + tl.arange(0, BK), K, stride).to(tl.float32)
        acc += tl.sum(b * b, 1)
    return tl.rsqrt(acc + 1e-6)


@triton.jit
def _block(q, k, g, A_log, dt_bias, lower_bound, qk_row0, gate_base, blk: tl.constexpr, n_left, i_hv, o_k,
           r_left, r_key, HV: tl.constexpr, H: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr,
           HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, SCORES: tl.constexpr):
    """One 16-token block in channels o_k [16, BK], on its own (blocks are independent): the
    gate's cumsum within the block L = G - c_(b-1) and the block's span s = L_15 = c_b - c_(b-1)
    [BK]; X = left e^L (left: unit keys, or scaled unit queries with SCORES) and
    F = k e^(s - L) = k e^(c_b - G), both <= 1 and exact at the block's ends (F_15 = k); the raw
    left rows and keys for the exact diagonal. Returns (X, F, left, k, L, s)."""
    x = _log_decay(g, A_log, dt_bias, lower_bound, gate_base, blk * 16 + tl.arange(0, 16), n_left, i_hv, o_k, HV, K,
                   GATE, HAS_A, HAS_BIAS)
    L = tl.cumsum(x, 0)
    span = tl.sum(tl.where(tl.arange(0, 16)[:, None] == 15, L, 0.0), 0)
    kb = _key_block(k, qk_row0, blk, n_left, o_k, K, H * K).to(tl.float32) * r_key[:, None]
    if SCORES:
        left = _key_block(q, qk_row0, blk, n_left, o_k, K, H * K).to(tl.float32) * r_left[:, None]
    else:
        left = kb
    X = left * tl.exp2(L)
    F = kb * tl.exp2(span[None, :] - L)
    return X, F, left, kb, L, span


@triton.jit
def _below(acc, X, F_c, DOT: tl.constexpr):
    """acc [16, 16] += X F_c^T (block c = b - 1, where e^(c_(b-1) - c_c) = 1)."""
    return tl.dot(X.to(DOT), tl.trans(F_c.to(DOT)), acc)


@triton.jit
def _below_far(acc, X, F_c, decay, DOT: tl.constexpr):
    """acc [16, 16] += X (F_c decay)^T for block c < b - 1, decay = e^(c_(b-1) - c_c) [BK] (the
    product of the spans' exponentials in between): every factor <= 1."""
    return tl.dot(X.to(DOT), tl.trans((F_c * decay[None, :]).to(DOT)), acc)


@triton.jit
def _diagonal_mid(acc, X, F, span, DOT: tl.constexpr):
    """acc += (X h) (F h)^T, h = e^(-span / 2): the factors around the block's mid value."""
    h = tl.exp2(-0.5 * span)[None, :]                                       # e^(c_prev - m) = e^(m - c_end)
    return tl.dot((X * h).to(DOT), tl.trans((F * h).to(DOT)), acc)


@triton.jit
def _diagonal(acc, X, F, left, kb, L, span, DOT: tl.constexpr, EXACT: tl.constexpr):
    """acc [16, 16] += the block's own per-channel products left_i . k_j e^(G_i - G_j) (all
    pairs; the caller masks j > i). Around the block's mid value m when its span -s is at most
    SPAN_LIMIT in every channel (factors within e^(+-s / 2)), else pair by pair; without EXACT
    (gates bounded below by -5: spans <= 80 by construction) always around m."""
    if EXACT:
        if tl.max(-span, 0) <= SPAN_LIMIT:
            acc = _diagonal_mid(acc, X, F, span, DOT)
        else:
            r = tl.arange(0, 16)
            for j in range(16):
                row = r[:, None] == j
                L_j = tl.sum(tl.where(row, L, 0.0), 0)                                         # [BK]
                k_j = tl.sum(tl.where(row, kb, 0.0), 0)
                keep = r[:, None] >= j
                e = tl.where(keep, tl.exp2(tl.where(keep, L - L_j[None, :], 0.0)), 0.0)         # [16, BK], <= 1
                acc += tl.where(r[None, :] == j, tl.sum(left * e * k_j[None, :], 1)[:, None], 0.0)
    else:
        acc = _diagonal_mid(acc, X, F, span, DOT)
    return acc


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _kda_prepare_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, scale, p_out, a_out, kg, kd, qg, decay,
    cu_seqlens, chunk_index, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
    HAS_BIAS: tl.constexpr, BETA: tl.constexpr, VARLEN: tl.constexpr, SCORES: tl.constexpr, EXACT: tl.constexpr,
    DELTA: tl.constexpr,
):
    """SCORES False: A, P, kg, kd and decay; SCORES True: Aqk and qg (same grid, second launch).
    DELTA False (GLA, the plain rule: no A, P nor kg): the first launch writes kd and decay only."""
    tl.static_assert(BT == 64, "four 16-token blocks")
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)                                                 # GVA: the q/k head
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * BT
    n_left = eos - t0                                                       # tokens of the chunk from t0, >= 1
    qk_row0 = (t0 * H + i_h) * K
    beta_base = t0 * HV + i_hv                                              # chunk row 0 in beta, P, Aqk
    gate_base = beta_base * K                                               # chunk row 0 in g, kg, kd, qg

    # 1 / |k| and scale / |q| per row of each block
    one = tl.full([16], 1.0, tl.float32)
    rk0, rk1, rk2, rk3 = one, one, one, one
    rq0, rq1, rq2, rq3 = one * scale, one * scale, one * scale, one * scale
    if L2NORM:
        rk0 = _row_norms(k, qk_row0, 0, n_left, K, BK, H * K)
        rk1 = _row_norms(k, qk_row0, 1, n_left, K, BK, H * K)
        rk2 = _row_norms(k, qk_row0, 2, n_left, K, BK, H * K)
        rk3 = _row_norms(k, qk_row0, 3, n_left, K, BK, H * K)
        if SCORES:
            rq0 = scale * _row_norms(q, qk_row0, 0, n_left, K, BK, H * K)
            rq1 = scale * _row_norms(q, qk_row0, 1, n_left, K, BK, H * K)
            rq2 = scale * _row_norms(q, qk_row0, 2, n_left, K, BK, H * K)
            rq3 = scale * _row_norms(q, qk_row0, 3, n_left, K, BK, H * K)

    z = tl.zeros([16, 16], dtype=tl.float32)
    a00, a10, a11, a20, a21, a22, a30, a31, a32, a33 = z, z, z, z, z, z, z, z, z, z
    # the gated keys (queries with SCORES) go out as soon as their block is done: X_b e^(c_(b-1))
    gated = qg if SCORES else kg
    for ks in range(0, tl.cdiv(K, BK)):
        o_k = ks * BK + tl.arange(0, BK)
        X0, F0, l0, k0, L0, s0 = _block(q, k, g, A_log, dt_bias, lower_bound, qk_row0, gate_base, 0, n_left, i_hv,
                                        o_k, rq0, rk0, HV, H, K, GATE, HAS_A, HAS_BIAS, SCORES)
        if SCORES or DELTA:                                                 # the products, kg / qg
            a00 = _diagonal(a00, X0, F0, l0, k0, L0, s0, DOT, EXACT)
            _store_rows(gated, gate_base, X0, 0, n_left, o_k, HV, K)
        d0 = tl.exp2(s0)                                                    # e^(c_0)
        X1, F1, l1, k1, L1, s1 = _block(q, k, g, A_log, dt_bias, lower_bound, qk_row0, gate_base, 1, n_left, i_hv,
                                        o_k, rq1, rk1, HV, H, K, GATE, HAS_A, HAS_BIAS, SCORES)
        if SCORES or DELTA:                                                 # the products, kg / qg
            a11 = _diagonal(a11, X1, F1, l1, k1, L1, s1, DOT, EXACT)
            a10 = _below(a10, X1, F0, DOT)
            _store_rows(gated, gate_base, X1 * d0[None, :], 1, n_left, o_k, HV, K)
        d1 = tl.exp2(s1)                                                    # e^(c_1 - c_0)
        X2, F2, l2, k2, L2, s2 = _block(q, k, g, A_log, dt_bias, lower_bound, qk_row0, gate_base, 2, n_left, i_hv,
                                        o_k, rq2, rk2, HV, H, K, GATE, HAS_A, HAS_BIAS, SCORES)
        if SCORES or DELTA:                                                 # the products, kg / qg
            a22 = _diagonal(a22, X2, F2, l2, k2, L2, s2, DOT, EXACT)
            a20 = _below_far(a20, X2, F0, d1, DOT)
            a21 = _below(a21, X2, F1, DOT)
            _store_rows(gated, gate_base, X2 * (d0 * d1)[None, :], 2, n_left, o_k, HV, K)
        d2 = tl.exp2(s2)
        X3, F3, l3, k3, L3, s3 = _block(q, k, g, A_log, dt_bias, lower_bound, qk_row0, gate_base, 3, n_left, i_hv,
                                        o_k, rq3, rk3, HV, H, K, GATE, HAS_A, HAS_BIAS, SCORES)
        if SCORES or DELTA:                                                 # the products, kg / qg
            a33 = _diagonal(a33, X3, F3, l3, k3, L3, s3, DOT, EXACT)
            a30 = _below_far(a30, X3, F0, d1 * d2, DOT)
            a31 = _below_far(a31, X3, F1, d2, DOT)
            a32 = _below(a32, X3, F2, DOT)
            _store_rows(gated, gate_base, X3 * (d0 * d1 * d2)[None, :], 3, n_left, o_k, HV, K)
        if not SCORES:                                                      # kd = F_b e^(c_3 - c_b), c_3 = G_last
            d3 = tl.exp2(s3)                                                # (the gates past the chunk's end are 0)
            d23 = d2 * d3
            _store_rows(kd, gate_base, F0 * (d1 * d23)[None, :], 0, n_left, o_k, HV, K)
            _store_rows(kd, gate_base, F1 * d23[None, :], 1, n_left, o_k, HV, K)
            _store_rows(kd, gate_base, F2 * d3[None, :], 2, n_left, o_k, HV, K)
            _store_rows(kd, gate_base, F3, 3, n_left, o_k, HV, K)
            tl.store(decay + (i_c * HV + i_hv) * K + o_k, d0 * d1 * d23, mask=o_k < K)

    r = tl.arange(0, 16)
    row0 = beta_base * BT
    if SCORES:
        lower = r[:, None] >= r[None, :]
        _store_lower(a_out, row0, tl.where(lower, a00, 0.0), a10, tl.where(lower, a11, 0.0), a20, a21,
                     tl.where(lower, a22, 0.0), a30, a31, a32, tl.where(lower, a33, 0.0), n_left, HV * BT, BT)
    elif DELTA:
        strict = r[:, None] > r[None, :]
        b0 = _beta_block(beta, beta_base, 0, n_left, HV, BETA)[:, None]
        b1 = _beta_block(beta, beta_base, 1, n_left, HV, BETA)[:, None]
        b2 = _beta_block(beta, beta_base, 2, n_left, HV, BETA)[:, None]
        b3 = _beta_block(beta, beta_base, 3, n_left, HV, BETA)[:, None]
        p00, p10, p11, p20, p21, p22, p30, p31, p32, p33 = _lower_inverse(
            tl.where(strict, b0 * a00, 0.0), b1 * a10, tl.where(strict, b1 * a11, 0.0), b2 * a20, b2 * a21,
            tl.where(strict, b2 * a22, 0.0), b3 * a30, b3 * a31, b3 * a32, tl.where(strict, b3 * a33, 0.0))
        _store_lower(p_out, row0, p00, p10, p11, p20, p21, p22, p30, p31, p32, p33, n_left, HV * BT, BT)


@triton.jit
def _load_block(a, row0, bi: tl.constexpr, bj: tl.constexpr, n_left, stride):
    """Block (bi, bj) [16, 16] of a chunk's [64, 64] matrix at a + row0 (row stride ``stride``), 0
    past the chunk's rows."""
    r = tl.arange(0, 16)
    t = bi * 16 + r
    x = tl.load(a + row0 + t[:, None] * stride + (bj * 16 + r)[None, :], mask=(t < n_left)[:, None], other=0.0)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _kda_inverse_kernel(a, p_out, beta, cu_seqlens, chunk_index, T, NT, HV: tl.constexpr, BT: tl.constexpr,
                        VARLEN: tl.constexpr, BETA: tl.constexpr, BETA_COLS: tl.constexpr):
    """P = (I + A)^-1 per chunk and value head from A (strictly lower, beta applied, fp32
    ``[B, T, HV, 64]``) as the sm_90 prologue writes it (backends/gluon/chunk_prepare_kda_sm90.py);
    grid (chunks, HV), one warp; the diagonal blocks' substitution loads A's rows as it needs them
    (1x8k H64: 67 us, against 120 with the rows extracted from registers). BETA_COLS: P diag(beta)
    (beta activated as BETA numbers it), each block's columns scaled before the one rounding."""
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * BT
    n_left = eos - t0
    base = t0 * HV + i_hv                                                                   # chunk row 0 in beta
    row0 = base * BT
    stride = HV * BT
    if BETA_COLS:               # (loaded first: their latency under the substitution, not after it)
        e0 = _beta_block(beta, base, 0, n_left, HV, BETA)[None, :]
        e1 = _beta_block(beta, base, 1, n_left, HV, BETA)[None, :]
        e2 = _beta_block(beta, base, 2, n_left, HV, BETA)[None, :]
        e3 = _beta_block(beta, base, 3, n_left, HV, BETA)[None, :]
    p00, p11, p22, p33 = _diag_inverses_rows(a, row0, 16, n_left, stride)                  # [16, 16] each
    p10, p20, p21, p30, p31, p32 = _lower_merge(
        p00, p11, p22, p33, _load_block(a, row0, 1, 0, n_left, stride), _load_block(a, row0, 2, 0, n_left, stride),
        _load_block(a, row0, 2, 1, n_left, stride), _load_block(a, row0, 3, 0, n_left, stride),
        _load_block(a, row0, 3, 1, n_left, stride), _load_block(a, row0, 3, 2, n_left, stride))
    if BETA_COLS:
        p00, p10, p20, p30 = p00 * e0, p10 * e0, p20 * e0, p30 * e0
        p11, p21, p31 = p11 * e1, p21 * e1, p31 * e1
        p22, p32, p33 = p22 * e2, p32 * e2, p33 * e3
    _store_lower(p_out, row0, p00, p10, p11, p20, p21, p22, p30, p31, p32, p33, n_left, stride, BT)


def launch_inverse(p, total: int, tables, a, inverse, warps: int = 1, beta=None, beta_mode: int = 0) -> None:
    """P = (I + A)^-1 into ``inverse`` from the fp32 A ``[B, T, HV, 64]`` of the sm_90 prologue;
    with ``beta`` ``[B, T, HV]`` (activated as ``beta_mode`` numbers it), P diag(beta)."""
    cu, chunk_index = tables
    varlen = cu is not None
    NT = -(-p.T // BT)
    launcher(_kda_inverse_kernel, p.T, NT)[(total, p.HV)](
        a, inverse, beta if beta is not None else a, cu if varlen else a, chunk_index if varlen else a, p.T, NT,
        HV=p.HV, BT=BT, VARLEN=varlen, BETA=beta_mode, BETA_COLS=beta is not None, num_warps=warps, num_stages=1)


@triton.jit
def _beta_block(beta, base, blk: tl.constexpr, n_left, HV: tl.constexpr, BETA: tl.constexpr):
    """beta of block ``blk``'s 16 tokens [16] (activated as the op asks; 0 off the chunk)."""
    t = blk * 16 + tl.arange(0, 16)
    return _activate_beta(tl.load(beta + base + t * HV, mask=t < n_left, other=0.0), t < n_left, BETA)


def gate_mode(p) -> int:
    """The recurrent kernel's numbering of the gate computed in the op (none, KDA, bounded KDA)."""
    if p.gate_in_op != "kda":
        return GATE_NONE
    return GATE_KDA if p.lower_bound is None else GATE_KDA_BOUNDED


def decaying_gate(p) -> bool:
    """Whether the log decay is <= 0 at every token by construction, so that 2^(G_i - G_j) <= 1 for
    i >= j: the gate computed in the op, softplus (-e^A_log softplus(x + dt_bias)) or bounded with
    lower_bound <= 0 (lower_bound sigmoid(.)). A given gate may rise."""
    return p.gate_in_op == "kda" and (p.lower_bound is None or p.lower_bound <= 0)


def bounded_spans(p) -> bool:
    """Whether every 16-token block's decay span is at most 16 x 5 <= SPAN_LIMIT by construction:
    the bounded gate computed in the op with lower_bound in [-5, 0] (safe_gate's range). A positive
    lower_bound (which only safe_gate rejects) makes the gate rise: the exact path serves it."""
    return p.gate_in_op == "kda" and p.lower_bound is not None and -5 <= p.lower_bound <= 0


def launch(p, q, k, beta, beta_mode: int, total: int, tables, inverse, scores, kg, kd, qg, decay, dot,
           block_k: int = 16, warps: int = 1, maxnreg: int | None = None) -> None:
    """Runs the prologue over ``total`` chunks (``tables`` = (cu_seqlens, chunk index) or Nones):
    writes P into ``inverse``, Aqk into ``scores`` ``[B, T, HV, BT]``, the gated keys and queries
    into ``kg``, ``kd``, ``qg`` ``[B, T, HV, K]`` and e^(G_last) into ``decay`` ``[total, HV, K]``
    (GLA, ``p.delta`` False: no P nor kg)."""
    cu, chunk_index = tables
    varlen = cu is not None
    dummy = decay
    NT = -(-p.T // BT)
    options = {} if maxnreg is None else {"maxnreg": maxnreg}
    for scores_pass in (False, True):
        launcher(_kda_prepare_kernel, p.T, NT)[(total, p.HV)](
            q, k, p.gk, beta, p.A_log if p.A_log is not None else dummy,
            p.dt_bias if p.dt_bias is not None else dummy,
            float(p.lower_bound) if p.lower_bound is not None else 0.0, p.scale,
            inverse, scores, kg, kd, qg, decay, cu if varlen else dummy,
            chunk_index if varlen else dummy, p.T, NT,
            H=p.H, HV=p.HV, K=p.K, BT=BT, BK=min(block_k, max(16, next_pow2(p.K))), DOT=dot,
            L2NORM=p.use_qk_l2norm, GATE=gate_mode(p), HAS_A=p.A_log is not None, HAS_BIAS=p.dt_bias is not None,
            BETA=beta_mode, VARLEN=varlen, SCORES=scores_pass, EXACT=not bounded_spans(p), DELTA=p.delta,
            num_warps=warps,
            num_stages=1, **options,
        )
