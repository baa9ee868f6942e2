"""Token-parallel prologue of the KDA chunked forward (Triton tier): per 64-token chunk and value
head, the per-channel gate's cumsum, the WY factor P, the causal scores and the gated keys and
queries that the scan (chunk_delta.py, ``GK``) multiplies with the state.

``_kda_prepare_kernel``, grid ``(chunks, HV)``, launched twice (SCORES False: A, P, kg, kd,
decay; SCORES True: Aqk, qg), 4 warps, K in slices of BK = 32 channels (fp32 [16, 16] block
accumulators across slices, mma.sync products). With G [BT, K] the in-chunk cumsum of
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
Two exponentials per gate element and launch; without bounded spans (EXACT) the pairwise path
is compiled in. P follows as in the GDN prologue (chunk_prepare.py):
the four diagonal blocks by forward substitution, the six lower blocks by block substitution.

Writes P and Aqk ``[B, T, HV, BT]`` (whole rows, zero above the block diagonal), kg, kd, qg
``[B, T, HV, K]`` in the product dtype and decay ``[chunks, HV, K]`` fp32. Budget (sm_90,
K = 128, tests/backends/test_triton_sm90.py): 234 / 216 registers at 4 warps, no spill.
Measured latency-bound (docs/notes/kda-prefill.md): 2.2 ms for both launches at 1x8k H64.
Traffic per token and value head (bf16, K = 128): 768 bytes of gated keys and queries and
256 of P and Aqk written; q and k read once per value head (from L2 within a GVA group).
Measurements: docs/notes/kda-prefill.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastla.backends.triton import next_pow2
from fastla.backends.triton.chunk_index import BT, _chunk
from fastla.backends.triton.chunk_prepare import _activate_beta, _key_block, _lower_inverse, _store_lower
from fastla.backends.triton.launch import launcher
from fastla.backends.triton.recurrent import GATE_KDA, GATE_KDA_BOUNDED, GATE_NONE

# the kernel works in log2 units (tl.exp2 is one MUFU.EX2; tl.exp adds four instructions)
LOG2E = tl.constexpr(1.4426950408889634)
# largest in-block decay span of the tensor-core diagonal form, 80 nats in log2 units: its
# factors stay within e^(+-40), far inside the bf16 / fp32 range for any key magnitude below 1e20
SPAN_LIMIT = tl.constexpr(80.0 * 1.4426950408889634)


@triton.jit
def _log_decay_rows(g, A_log, dt_bias, lower_bound, base, blk: tl.constexpr, n_left, i_hv, o_k, HV: tl.constexpr,
                    K: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Log2 decay of the chunk's rows 16 blk .. 16 blk + 15 in channels o_k [16, BK] (the KDA gate
    when GATE is in the op, times log2(e)); 0 off the chunk and off the K channels, so the cumsum
    holds G_last past the chunk's end."""
    t = blk * 16 + tl.arange(0, 16)
    m = (t < n_left)[:, None] & (o_k < K)[None, :]
    x = tl.load(g + base + t[:, None] * (HV * K) + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    if GATE != 0:
        if HAS_BIAS:
            x = x + tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)[None, :]
        if HAS_A:
            a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        else:
            a = 1.0
        if GATE == 2:                                                       # -a softplus(x) log2(e)
            x = -a * tl.where(x > 20.0, LOG2E * x, tl.log2(1.0 + tl.exp2(LOG2E * x)))
        else:                                                               # lower_bound sigmoid(a x) log2(e)
            x = (LOG2E * lower_bound) / (1.0 + tl.exp2(-LOG2E * a * x))
        return tl.where(m, x, 0.0)
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
           c_prev, r_left, r_key, HV: tl.constexpr, H: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr,
           HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, SCORES: tl.constexpr):
    """One 16-token block in channels o_k: its gate cumsum G [16, BK] from c_prev (the cumsum
    before it) and c_end; X = left e^(G - c_prev) (left: unit keys, or scaled unit queries with
    SCORES) and F = k e^(c_end - G), both <= 1; the raw left rows and keys for the exact diagonal.
    Returns (X, F, left, k, G, c_end)."""
    x = _log_decay_rows(g, A_log, dt_bias, lower_bound, gate_base, blk, n_left, i_hv, o_k, HV, K, GATE, HAS_A,
                        HAS_BIAS)
    G = tl.cumsum(x, 0) + c_prev[None, :]
    c_end = c_prev + tl.sum(x, 0)
    kb = _key_block(k, qk_row0, blk, n_left, o_k, K, H * K).to(tl.float32) * r_key[:, None]
    if SCORES:
        left = _key_block(q, qk_row0, blk, n_left, o_k, K, H * K).to(tl.float32) * r_left[:, None]
    else:
        left = kb
    X = left * tl.exp2(G - c_prev[None, :])
    F = kb * tl.exp2(c_end[None, :] - G)
    return X, F, left, kb, G, c_end


@triton.jit
def _below(acc, X, F_c, c_prev, c_c, DOT: tl.constexpr):
    """acc [16, 16] += X (F_c e^(c_(b-1) - c_c))^T for block c < b: every factor <= 1."""
    R = F_c * tl.exp2(c_prev - c_c)[None, :]
    return tl.dot(X.to(DOT), tl.trans(R.to(DOT)), acc)


@triton.jit
def _diagonal_mid(acc, X, F, c_prev, c_end, DOT: tl.constexpr):
    """acc += (X h) (F h)^T, h = e^((c_prev - c_end) / 2): the factors around the block's mid value."""
    h = tl.exp2(0.5 * (c_prev - c_end))[None, :]                             # e^(c_prev - m) = e^(m - c_end)
    return tl.dot((X * h).to(DOT), tl.trans((F * h).to(DOT)), acc)


@triton.jit
def _diagonal(acc, X, F, left, kb, G, c_prev, c_end, DOT: tl.constexpr, EXACT: tl.constexpr):
    """acc [16, 16] += the block's own per-channel products left_i . k_j e^(G_i - G_j) (all
    pairs; the caller masks j > i). Around the block's mid value m when its span c_prev - c_end
    is at most SPAN_LIMIT in every channel (factors within e^(+-span / 2)), else pair by pair;
    without EXACT (gates bounded below by -5: spans <= 80 by construction) always around m."""
    if EXACT:
        span = tl.max(c_prev - c_end, 0)
        if span <= SPAN_LIMIT:
            acc = _diagonal_mid(acc, X, F, c_prev, c_end, DOT)
        else:
            r = tl.arange(0, 16)
            for j in range(16):
                row = r[:, None] == j
                G_j = tl.sum(tl.where(row, G, 0.0), 0)                                         # [BK]
                k_j = tl.sum(tl.where(row, kb, 0.0), 0)
                keep = r[:, None] >= j
                e = tl.where(keep, tl.exp2(tl.where(keep, G - G_j[None, :], 0.0)), 0.0)         # [16, BK], <= 1
                acc += tl.where(r[None, :] == j, tl.sum(left * e * k_j[None, :], 1)[:, None], 0.0)
    else:
        acc = _diagonal_mid(acc, X, F, c_prev, c_end, DOT)
    return acc


@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _kda_prepare_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, scale, p_out, a_out, kg, kd, qg, decay,
    cu_seqlens, chunk_index, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
    HAS_BIAS: tl.constexpr, BETA: tl.constexpr, VARLEN: tl.constexpr, SCORES: tl.constexpr, EXACT: tl.constexpr,
):
    """SCORES False: A, P, kg, kd and decay; SCORES True: Aqk and qg (same grid, second launch)."""
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
    for ks in range(0, tl.cdiv(K, BK)):
        o_k = ks * BK + tl.arange(0, BK)
        c_start = tl.zeros([BK], dtype=tl.float32)
        X0, F0, l0, k0, G0, c0 = _block(q, k, g, A_log, dt_bias, lower_bound, qk_row0, gate_base, 0, n_left, i_hv,
                                        o_k, c_start, rq0, rk0, HV, H, K, GATE, HAS_A, HAS_BIAS, SCORES)
        a00 = _diagonal(a00, X0, F0, l0, k0, G0, c_start, c0, DOT, EXACT)
        X1, F1, l1, k1, G1, c1 = _block(q, k, g, A_log, dt_bias, lower_bound, qk_row0, gate_base, 1, n_left, i_hv,
                                        o_k, c0, rq1, rk1, HV, H, K, GATE, HAS_A, HAS_BIAS, SCORES)
        a11 = _diagonal(a11, X1, F1, l1, k1, G1, c0, c1, DOT, EXACT)
        a10 = _below(a10, X1, F0, c0, c0, DOT)
        X2, F2, l2, k2, G2, c2 = _block(q, k, g, A_log, dt_bias, lower_bound, qk_row0, gate_base, 2, n_left, i_hv,
                                        o_k, c1, rq2, rk2, HV, H, K, GATE, HAS_A, HAS_BIAS, SCORES)
        a22 = _diagonal(a22, X2, F2, l2, k2, G2, c1, c2, DOT, EXACT)
        a20 = _below(a20, X2, F0, c1, c0, DOT)
        a21 = _below(a21, X2, F1, c1, c1, DOT)
        X3, F3, l3, k3, G3, c3 = _block(q, k, g, A_log, dt_bias, lower_bound, qk_row0, gate_base, 3, n_left, i_hv,
                                        o_k, c2, rq3, rk3, HV, H, K, GATE, HAS_A, HAS_BIAS, SCORES)
        a33 = _diagonal(a33, X3, F3, l3, k3, G3, c2, c3, DOT, EXACT)
        a30 = _below(a30, X3, F0, c2, c0, DOT)
        a31 = _below(a31, X3, F1, c2, c1, DOT)
        a32 = _below(a32, X3, F2, c2, c2, DOT)
        # c3 = G_last in these channels (the gates past the chunk's end are 0)
        if SCORES:                                                          # qg = scale q e^G
            _store_rows(qg, gate_base, X0, 0, n_left, o_k, HV, K)
            _store_rows(qg, gate_base, X1 * tl.exp2(c0)[None, :], 1, n_left, o_k, HV, K)
            _store_rows(qg, gate_base, X2 * tl.exp2(c1)[None, :], 2, n_left, o_k, HV, K)
            _store_rows(qg, gate_base, X3 * tl.exp2(c2)[None, :], 3, n_left, o_k, HV, K)
        else:                                                               # kg = k e^G, kd = k e^(G_last - G)
            _store_rows(kg, gate_base, X0, 0, n_left, o_k, HV, K)
            _store_rows(kg, gate_base, X1 * tl.exp2(c0)[None, :], 1, n_left, o_k, HV, K)
            _store_rows(kg, gate_base, X2 * tl.exp2(c1)[None, :], 2, n_left, o_k, HV, K)
            _store_rows(kg, gate_base, X3 * tl.exp2(c2)[None, :], 3, n_left, o_k, HV, K)
            _store_rows(kd, gate_base, F0 * tl.exp2(c3 - c0)[None, :], 0, n_left, o_k, HV, K)
            _store_rows(kd, gate_base, F1 * tl.exp2(c3 - c1)[None, :], 1, n_left, o_k, HV, K)
            _store_rows(kd, gate_base, F2 * tl.exp2(c3 - c2)[None, :], 2, n_left, o_k, HV, K)
            _store_rows(kd, gate_base, F3, 3, n_left, o_k, HV, K)
            tl.store(decay + (i_c * HV + i_hv) * K + o_k, tl.exp2(c3), mask=o_k < K)

    r = tl.arange(0, 16)
    row0 = beta_base * BT
    if SCORES:
        lower = r[:, None] >= r[None, :]
        _store_lower(a_out, row0, tl.where(lower, a00, 0.0), a10, tl.where(lower, a11, 0.0), a20, a21,
                     tl.where(lower, a22, 0.0), a30, a31, a32, tl.where(lower, a33, 0.0), n_left, HV * BT, BT)
    else:
        strict = r[:, None] > r[None, :]
        b0 = _beta_rows(beta, beta_base, 0, n_left, HV, BETA)
        b1 = _beta_rows(beta, beta_base, 1, n_left, HV, BETA)
        b2 = _beta_rows(beta, beta_base, 2, n_left, HV, BETA)
        b3 = _beta_rows(beta, beta_base, 3, n_left, HV, BETA)
        p00, p10, p11, p20, p21, p22, p30, p31, p32, p33 = _lower_inverse(
            tl.where(strict, b0 * a00, 0.0), b1 * a10, tl.where(strict, b1 * a11, 0.0), b2 * a20, b2 * a21,
            tl.where(strict, b2 * a22, 0.0), b3 * a30, b3 * a31, b3 * a32, tl.where(strict, b3 * a33, 0.0))
        _store_lower(p_out, row0, p00, p10, p11, p20, p21, p22, p30, p31, p32, p33, n_left, HV * BT, BT)


@triton.jit
def _beta_rows(beta, base, blk: tl.constexpr, n_left, HV: tl.constexpr, BETA: tl.constexpr):
    """beta of the block's 16 rows as a column [16, 1] (activated as the op asks; 0 off the chunk)."""
    t = blk * 16 + tl.arange(0, 16)
    return _activate_beta(tl.load(beta + base + t * HV, mask=t < n_left, other=0.0), t < n_left, BETA)[:, None]


def gate_mode(p) -> int:
    """The recurrent kernel's numbering of the gate computed in the op (none, KDA, bounded KDA)."""
    if p.gate_in_op != "kda":
        return GATE_NONE
    return GATE_KDA if p.lower_bound is None else GATE_KDA_BOUNDED


def bounded_spans(p) -> bool:
    """Whether every 16-token block's decay span is at most 16 x 5 <= SPAN_LIMIT by construction:
    the bounded gate computed in the op with lower_bound >= -5 (safe_gate's range)."""
    return p.gate_in_op == "kda" and p.lower_bound is not None and p.lower_bound >= -5


def launch(p, q, k, beta, beta_mode: int, total: int, tables, inverse, scores, kg, kd, qg, decay, dot,
           block_k: int = 32, warps: int = 4, maxnreg: int | None = None) -> None:
    """Runs the prologue over ``total`` chunks (``tables`` = (cu_seqlens, chunk index) or Nones):
    writes P into ``inverse``, Aqk into ``scores`` ``[B, T, HV, BT]``, the gated keys and queries
    into ``kg``, ``kd``, ``qg`` ``[B, T, HV, K]`` and e^(G_last) into ``decay`` ``[total, HV, K]``."""
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
            inverse, scores, kg, kd, qg, decay, cu if varlen else dummy, chunk_index if varlen else dummy, p.T, NT,
            H=p.H, HV=p.HV, K=p.K, BT=BT, BK=min(block_k, max(16, next_pow2(p.K))), DOT=dot,
            L2NORM=p.use_qk_l2norm, GATE=gate_mode(p), HAS_A=p.A_log is not None, HAS_BIAS=p.dt_bias is not None,
            BETA=beta_mode, VARLEN=varlen, SCORES=scores_pass, EXACT=not bounded_spans(p), num_warps=warps,
            num_stages=1, **options,
        )
