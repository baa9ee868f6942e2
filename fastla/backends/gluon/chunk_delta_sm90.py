"""Hopper (sm_90) chunk scan of the GDN and KDA forwards, with the output fused: Gluon, TMA, async wgmma.

The prologue is the Triton tier's (backends/triton/chunk_prepare.py): per 64-token chunk and
value head G = cumsum(g), P = (I + A)^-1 (whole rows, zero above the block diagonal), the causal
scores A_qk = scale diag(rq) q k^T diag(rk) e^(G_i - G_j) and 1 / |q|, 1 / |k|. This kernel
replaces the Triton scan's sequence passes (segment 0: whole sequences, 2: segment replays);
the segment summary pass and the combine stay in Triton.

Inputs (bf16 unless noted): k, q ``[B * T, H * K]``, v ``[B * T, HV * V]``, P and A_qk
``[B * T, HV * 64]``, all through TMA descriptors of [64, 64] boxes ([64, BV] for v); beta (raw),
G, rq, rk (fp32) by plain loads; h0 / ht / chunk states fp32 ``[.., K, V]`` or ``[.., V, K]``.
Rows past a sequence's end come from the next sequence (or TMA's zero fill): they are finite,
beta and the update weights are zero there, and their outputs are not stored. Output o
``[B * T, HV * V]`` through a TMA descriptor of [64, BV] boxes (``n_rows`` = B * T).

Grid ``(sequences or segments x HV x V / BV,)`` (``_program``), 4 x WARPGROUPS warps: the state slab S
``[K, BV]`` fp32 lives in registers as K / 64 halves ``[64, BV]``, its columns split over the
warpgroups (each issues its own products on the shared tiles). No producer/consumer
specialization here: chunk_delta_dual_sm90.py runs this kernel's chunk step (``_chunk_step``) on
two chains per program with a loader warp (what ships where it serves), chunk_delta_ws_sm90.py is
the warp-specialized variant (opt-in). The tiles of STAGES chunks are in flight (TMA into stage ``i % STAGES``, one
mbarrier per stage, a stage refilled as soon as its chunk is done); the row vectors (G, raw
beta, 1/|k|, 1/|q|) are loaded one chunk ahead into registers and used a chunk later. Per chunk
(S in bf16 shared memory from the previous chunk):
    X = k S  and  Q = q S  issued together, wait for X only
    Y = beta (v - rk e^G X) -> smem;  V_new = P Y  (wait: V_new and Q)
    V_new, D = diag(rk e^(G_last - G)) V_new -> smem
    S = e^G_last S + k^T D  then  O = diag(scale rq e^G) Q + A_qk V_new  issued; wait for S,
    S -> bf16 smem (while O runs), wait for O
    O -> smem -> TMA store (a sequence's partial last chunk: masked stores instead)
so four dependent waits per chunk instead of the Triton scan's six serialized products.

GK (KDA, per-channel gates; the prologue is chunk_prepare_kda_sm90.py where it serves, else
backends/triton/chunk_prepare_kda.py): k_desc and
q_desc hold the gated keys kg = k e^G and queries qg = scale q e^G per value head
``[B * T, HV * K]``, kd_desc kd = k e^(G_last - G), and ``decay`` e^(G_last) ``[chunks, HV, K]``
fp32; the step is Y = beta (v - kg S), V_new = P Y, S = diag(e^G_last) S + kd^T V_new (V_new's
rows past a sequence's end zeroed: the tile's next-sequence kd rows must not reach S),
O = qg S + A_qk V_new. The third K-wide tile makes 188 KB of shared memory at BV 64 (224
registers); 128 columns would need 245 KB, so KDA runs 32 or 64.

DELTA False (the plain rule: Simple GLA and Lightning, GLA with GK): V_new = v, so the step is
Q = q S under the values' load, then the state update and O as above; P and beta are not read
(nor, with GK, the gated keys: the update reads kd).

Budget (K = V = 128, STAGES = 2, sm_90 compile): BV 32 168 registers, 131 KB of shared memory;
BV 64 254 registers, 164 KB; BV 128 on two warpgroups 255 registers, 229 KB (one program per SM
at every width); no spills, HGMMA and UTMALDG in the SASS (tests/backends/test_gluon_sm90.py).
A cycle profile of one step (benchmarks/gdn_scan_profile.py, docs/notes/gdn-prefill.md v9): ~2350 cycles at BV 32, ~3100 at
BV 64, the products about half of it.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from fastla.backends.triton.chunk_index import _sequence
from fastla.backends.triton.chunk_prepare import _activate_beta

BT = gl.constexpr(64)     # tokens per chunk (the prologue's)
BK = gl.constexpr(64)     # key columns per TMA box and per state half


@gluon.jit
def _inv_norms(rq, rk, t0, r, m_t, i_h, H: gl.constexpr, L2NORM: gl.constexpr):
    """1/|k|, 1/|q| [BT] of the chunk's rows at t0 (0 past ``m_t``; 1 without the l2norm in the op)."""
    if L2NORM:
        b_rk = gl.load(rk + (t0 + r) * H + i_h, mask=m_t, other=0.0)
        b_rq = gl.load(rq + (t0 + r) * H + i_h, mask=m_t, other=0.0)
    else:
        b_rk = gl.where(m_t, 1.0, 0.0)
        b_rq = b_rk
    return b_rk, b_rq


@gluon.jit
def _chunk_vectors(gcum, beta, rq, rk, r, bos, eos, c, valid, i_h, i_hv, H: gl.constexpr, HV: gl.constexpr,
                   L2NORM: gl.constexpr, GK: gl.constexpr):
    """Chunk c's per-row G, raw beta, 1/|k|, 1/|q| [BT] and its last row's G (0 where not ``valid``).
    Nothing here uses the loaded values, so loads issued a chunk ahead are waited for a chunk
    later (activating beta here stalled every step on the load). The warp-specialized scan's
    chain loads the same less beta (chunk_delta_ws_sm90._row_vectors; one function here changes
    this kernel's load order and SASS)."""
    t0 = bos + c * BT
    m_t = (r < eos - t0) & valid
    row = (t0 + r) * HV + i_hv
    b_beta = gl.load(beta + row, mask=m_t, other=0.0)
    if GK:                                                  # the gates are in the prologue's gated tiles
        b_G = gl.where(m_t, 0.0, 0.0)
        b_Gl = 0.0
    else:
        b_G = gl.load(gcum + row, mask=m_t, other=0.0)
        b_Gl = gl.load(gcum + (gl.minimum(eos, t0 + BT) - 1) * HV + i_hv, mask=valid, other=0.0)
    b_rk, b_rq = _inv_norms(rq, rk, t0, r, m_t, i_h, H, L2NORM)
    return b_G, b_Gl, b_beta, b_rk, b_rq


@gluon.jit
def _issue_chunk(k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, bar, stage, t0,
                 i_h, i_hv, i_v, pred, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NK: gl.constexpr,
                 GK: gl.constexpr, DELTA: gl.constexpr):
    """TMA loads of one chunk's tiles into ``stage``, completing on ``bar``. GK: the gated keys
    and queries are per value head (column block i_hv; i_h is passed as i_hv), plus kd. DELTA
    False (the plain rule): no P, and with GK no gated keys (the update reads kd)."""
    LOAD_K: gl.constexpr = DELTA or not GK
    nbytes: gl.constexpr = (((1 if LOAD_K else 0) + (2 if GK else 1)) * NK * BT * BK + BT * BV
                            + (2 if DELTA else 1) * BT * BT) * 2
    mbarrier.expect(bar, nbytes, pred=pred)
    for j in gl.static_range(NK):
        if LOAD_K:
            tma.async_copy_global_to_shared(k_desc, [t0, i_h * K + j * BK], bar, k_s.index(stage * NK + j),
                                            pred=pred)
        tma.async_copy_global_to_shared(q_desc, [t0, i_h * K + j * BK], bar, q_s.index(stage * NK + j), pred=pred)
        if GK:
            tma.async_copy_global_to_shared(kd_desc, [t0, i_h * K + j * BK], bar, kd_s.index(stage * NK + j),
                                            pred=pred)
    tma.async_copy_global_to_shared(v_desc, [t0, i_hv * V + i_v * BV], bar, v_s.index(stage), pred=pred)
    if DELTA:
        tma.async_copy_global_to_shared(p_desc, [t0, i_hv * BT], bar, p_s.index(stage), pred=pred)
    tma.async_copy_global_to_shared(a_desc, [t0, i_hv * BT], bar, a_s.index(stage), pred=pred)


@gluon.jit
def _program(segments, cu_seqlens, chunk_start, T, NT, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
             V: gl.constexpr, BV: gl.constexpr, VARLEN: gl.constexpr, SEG: gl.constexpr):
    """This program's value tile, value head, q/k head, sequence (or segment) and chunk range:
    (i_v, i_hv, i_h, i_s, i_n, bos, eos, first_chunk, c_begin, n_chunks, is_last), i_v int32,
    the rest int64. The grid is 1-D, the value tiles fastest, then the value heads, then the
    sequences (or segments), so a sequence's programs are dispatched together; whole varlen
    sequences (SEG 0) are taken in the order of the table ``segments`` (longest first: the
    longest lane starts in the first wave instead of behind the short ones)."""
    TILES: gl.constexpr = (V + K) // BV if SEG == 1 else V // BV       # a summary's V + K columns
    i_p = gl.program_id(0).to(gl.int64)
    i_v = (i_p % TILES).to(gl.int32)
    i_hv = (i_p // TILES) % HV
    i_h = i_hv // (HV // H)
    i_s = i_p // (TILES * HV)
    if SEG == 0:
        if VARLEN:
            i_n = gl.load(segments + i_s).to(gl.int64)
        else:
            i_n = i_s
        c_begin = i_n * 0
        is_last = i_n >= 0
    else:
        i_n = gl.load(segments + 4 * i_s).to(gl.int64)
        c_begin = gl.load(segments + 4 * i_s + 1).to(gl.int64)
        is_last = gl.load(segments + 4 * i_s + 3) != 0
    bos, eos, first_chunk = _sequence(cu_seqlens, chunk_start, i_n, T, NT, VARLEN)
    if SEG == 0:
        n_chunks = (eos - bos + BT - 1) // BT
    else:
        n_chunks = gl.load(segments + 4 * i_s + 2).to(gl.int64)
    return i_v, i_hv, i_h, i_s, i_n, bos, eos, first_chunk, c_begin, n_chunks, is_last


@gluon.jit
def _initial_state(h0, seg_state, i_n, i_s, i_hv, o_j, o_v, p_half, acc: gl.constexpr, HV: gl.constexpr,
                   K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, SK: gl.constexpr, HAS_H0: gl.constexpr,
                   SEG: gl.constexpr):
    """The state halves [BK, BV] fp32 (key rows j * 64 ..) a program starts from: a segment
    summary's [0 | I] (o_v over the V + K columns), a segment replay's recovered state, h0, or
    zeros."""
    NK: gl.constexpr = K // BK
    S0 = gl.zeros([BK, BV], gl.float32, acc)
    S1 = gl.zeros([BK, BV], gl.float32, acc)
    if SEG == 1:
        S0 = gl.where(o_j[:, None] == (o_v - V)[None, :], 1.0, 0.0)
        S1 = gl.where((o_j + BK)[:, None] == (o_v - V)[None, :], 1.0, 0.0)
    elif SEG == 2:
        seg_base = seg_state + (i_s * HV + i_hv) * K * V + o_j[:, None] * V + o_v[None, :]
        S0 = gl.load(seg_base)
        if NK == 2:
            S1 = gl.load(seg_base + BK * V)
    elif HAS_H0:
        h0_base = h0 + (i_n * HV + i_hv) * K * V + p_half
        S0 = gl.load(h0_base).to(gl.float32)
        if NK == 2:
            S1 = gl.load(h0_base + BK * SK).to(gl.float32)
    return S0, S1


@gluon.jit
def _store_half_pair(base, S0, S1, K: gl.constexpr, SK: gl.constexpr):
    """A state's halves [BK, BV] (key rows j * 64 ..) stored at ``base`` (a chunk's state)."""
    gl.store(base, S0.to(base.dtype.element_ty))
    if K // BK == 2:
        gl.store(base + BK * SK, S1.to(base.dtype.element_ty))


@gluon.jit
def _chunk_decay(decay, chunk, i_hv, o_j, HV: gl.constexpr, K: gl.constexpr, GK: gl.constexpr):
    """GK: the chunk's e^G_last per key row of each state half [BK] (loaded before the chunk's
    tiles are waited for); GDN: unused zeros."""
    if GK:
        dec = decay + (chunk * HV + i_hv) * K + o_j
        b_dec0 = gl.load(dec)
        b_dec1 = b_dec0
        if K // BK == 2:
            b_dec1 = gl.load(dec + BK)
    else:
        b_dec0 = 0.0
        b_dec1 = 0.0
    return b_dec0, b_dec1


@gluon.jit
def _chunk_rows(gcum, beta, rq, rk, decay, h_chunks, r, o_j, p_half, S0, S1, n_G, n_Gl, n_beta, n_rk, n_rq,
                bos, eos, c, i, n_chunks, first_chunk, i_h, i_hv, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                V: gl.constexpr, SK: gl.constexpr, L2NORM: gl.constexpr, BETA: gl.constexpr, GK: gl.constexpr,
                STORE_STATES: gl.constexpr):
    """A step's work before its tiles are waited for: chunk c's first token t0 and row mask, its row
    vectors (loaded a chunk ago, beta activated now), the next chunk's row vectors issued (if step i
    has a next one), the chunk's decays (GK) and, with STORE_STATES, the state entering it stored.
    Returns t0, m_t, G, G_last, beta, 1/|k|, 1/|q|, the decays, and the next chunk's five loads."""
    t0 = bos + c * BT
    m_t = r < eos - t0
    b_G, b_Gl, b_rk, b_rq = n_G, n_Gl, n_rk, n_rq
    b_beta = _activate_beta(n_beta, m_t, BETA)
    n_G, n_Gl, n_beta, n_rk, n_rq = _chunk_vectors(gcum, beta, rq, rk, r, bos, eos, c + 1, i + 1 < n_chunks,
                                                   i_h, i_hv, H, HV, L2NORM, GK)
    b_dec0, b_dec1 = _chunk_decay(decay, first_chunk + c, i_hv, o_j, HV, K, GK)
    if STORE_STATES:
        _store_half_pair(h_chunks + ((first_chunk + c) * HV + i_hv) * K * V + p_half, S0, S1, K, SK)
    return t0, m_t, b_G, b_Gl, b_beta, b_rk, b_rq, b_dec0, b_dec1, n_G, n_Gl, n_beta, n_rk, n_rq


@gluon.jit
def _chunk_step(k_s, q_s, kd_s, kb, v_t, p_t, a_t, s_s, sb, y_t, vn_t, vd_t, S0, S1, zero,
                b_G, b_Gl, b_beta, b_rk, b_rq, b_dec0, b_dec1, m_t, scale, has_v,
                acc: gl.constexpr, NK: gl.constexpr, GK: gl.constexpr, OUTPUT: gl.constexpr, DELTA: gl.constexpr):
    """One chunk's products, its tiles landed: keys, queries (and kd) at ring index kb (and
    kb + 1), the values v_t, P and A_qk; S in bf16 at s_s index sb (and sb + 1), rewritten here
    for the next chunk. Returns the new state halves (fp32) and the output [BT, BV] (fp32).
    Not OUTPUT (a segment summary): no Q, no output (``zero`` returned), and the values read as
    zeros unless ``has_v`` (the identity columns' tiles). DELTA False (the plain rule: GLA, Simple
    GLA, Lightning): V_new = v, so neither k S nor P Y (nor the keys, with GK, nor P are read)."""
    if DELTA:
        # X = k S and Q = q S
        x = warpgroup_mma(k_s.index(kb), s_s.index(sb), zero, use_acc=False, is_async=True)
        if NK == 2:
            x = warpgroup_mma(k_s.index(kb + 1), s_s.index(sb + 1), x, is_async=True)
        if OUTPUT:
            qs = warpgroup_mma(q_s.index(kb), s_s.index(sb), zero, use_acc=False, is_async=True)
            if NK == 2:
                qs = warpgroup_mma(q_s.index(kb + 1), s_s.index(sb + 1), qs, is_async=True)
            x = warpgroup_mma_wait(num_outstanding=NK, deps=(x,))
        else:
            x = warpgroup_mma_wait(num_outstanding=0, deps=(x,))
        # Y = beta (v - rk e^G X) (GK: beta (v - X), the keys gated already);  V_new = P Y
        b_v = v_t.load(acc).to(gl.float32)
        if not OUTPUT:
            b_v = gl.where(has_v, b_v, 0.0)
        if GK:
            b_y = b_beta[:, None] * (b_v - x)
        else:
            b_eg = gl.exp(b_G)
            b_y = b_beta[:, None] * (b_v - (b_rk * b_eg)[:, None] * x)
        y_t.store(b_y.to(gl.bfloat16))
        fence_async_shared()
        vn = warpgroup_mma(p_t, y_t, zero, use_acc=False, is_async=True)
        if OUTPUT:
            vn, qs = warpgroup_mma_wait(num_outstanding=0, deps=(vn, qs))
        else:
            vn = warpgroup_mma_wait(num_outstanding=0, deps=(vn,))
    else:
        # Q = q S under the values' load;  V_new = v
        if OUTPUT:
            qs = warpgroup_mma(q_s.index(kb), s_s.index(sb), zero, use_acc=False, is_async=True)
            if NK == 2:
                qs = warpgroup_mma(q_s.index(kb + 1), s_s.index(sb + 1), qs, is_async=True)
        vn = v_t.load(acc).to(gl.float32)
        if not OUTPUT:
            vn = gl.where(has_v, vn, 0.0)
        if not GK:
            b_eg = gl.exp(b_G)
        if OUTPUT:
            qs = warpgroup_mma_wait(num_outstanding=0, deps=(qs,))
    # O = diag(scale rq e^G) Q + A_qk V_new;  S = e^G_last S + k^T diag(rk e^(G_last - G)) V_new
    # (GK: O = Q + A_qk V_new;  S = diag(e^G_last) S + kd^T V_new, the rows' decays per chunk)
    if GK:                  # rows past the sequence's end (the next one's kd rows) must not update S
        vn_t.store(gl.where(m_t[:, None], vn, 0.0).to(gl.bfloat16))
        fence_async_shared()
        S0 = warpgroup_mma(kd_s.index(kb).permute((1, 0)), vn_t, S0 * b_dec0[:, None], is_async=True)
        if NK == 2:
            S1 = warpgroup_mma(kd_s.index(kb + 1).permute((1, 0)), vn_t, S1 * b_dec1[:, None], is_async=True)
        if OUTPUT:
            out = warpgroup_mma(a_t, vn_t, qs, is_async=True)
    else:
        if OUTPUT and DELTA:        # (the plain rule's V_new is v: the output reads the values' tile)
            vn_t.store(vn.to(gl.bfloat16))
        b_d = gl.where(m_t, b_rk * gl.exp(b_Gl - b_G), 0.0)
        vd_t.store((vn * b_d[:, None]).to(gl.bfloat16))
        fence_async_shared()
        b_egl = gl.exp(b_Gl)
        S0 = warpgroup_mma(k_s.index(kb).permute((1, 0)), vd_t, S0 * b_egl, is_async=True)
        if NK == 2:
            S1 = warpgroup_mma(k_s.index(kb + 1).permute((1, 0)), vd_t, S1 * b_egl, is_async=True)
        if OUTPUT:
            out = warpgroup_mma(a_t, vn_t if DELTA else v_t, qs * (scale * b_rq * b_eg)[:, None], is_async=True)
    # the state first (the output's product runs on): S -> bf16 smem for the next chunk's products
    PENDING: gl.constexpr = 1 if OUTPUT else 0
    if NK == 2:
        S0, S1 = warpgroup_mma_wait(num_outstanding=PENDING, deps=(S0, S1))
        s_s.index(sb + 1).store(S1.to(gl.bfloat16))
    else:
        S0 = warpgroup_mma_wait(num_outstanding=PENDING, deps=(S0,))
    s_s.index(sb).store(S0.to(gl.bfloat16))
    fence_async_shared()
    if OUTPUT:
        out = warpgroup_mma_wait(num_outstanding=0, deps=(out,))
    else:
        out = zero
    return S0, S1, out


@gluon.jit
def _store_output(out, o_desc, o_s, o, t0, eos, r, o_v, i_hv, i_v, n_rows, HV: gl.constexpr, V: gl.constexpr,
                  BV: gl.constexpr):
    """A chunk's output [BT, BV]: a whole chunk by a TMA store from shared memory (the previous
    chunk's store, issued a step ago, has left the tile); a sequence's partial last chunk by
    masked stores, its tile sent past the last row (TMA writes nothing out of bounds; a whole
    tile would reach the next sequence). No branch: ptxas (sm_90a) crashes on one around the TMA
    store."""
    whole = eos - t0 >= BT
    tma.store_wait(0)
    gl.thread_barrier()
    o_s.store(out.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [gl.where(whole, t0, n_rows).to(gl.int32), i_hv * V + i_v * BV], o_s)
    o_ptr = o + ((t0 + r) * HV + i_hv)[:, None] * V + o_v[None, :]
    gl.store(o_ptr, out.to(o.dtype.element_ty), mask=(r < eos - t0)[:, None] & (eos - t0 < BT))


@gluon.jit
def _store_final(ht, S0, S1, i_n, i_hv, p_half, o_j, is_last, HV: gl.constexpr, K: gl.constexpr,
                 V: gl.constexpr, SK: gl.constexpr):
    """The final state (segments: the last one's only)."""
    NK: gl.constexpr = K // BK
    ht_base = ht + (i_n * HV + i_hv) * K * V + p_half
    m_last = (o_j >= 0)[:, None] & is_last
    gl.store(ht_base, S0.to(ht.dtype.element_ty), mask=m_last)
    if NK == 2:
        gl.store(ht_base + BK * SK, S1.to(ht.dtype.element_ty), mask=m_last)


@gluon.jit(do_not_specialize=["T", "NT", "n_rows"])     # T = 1 would compile a variant of its own
def _scan_sm90_kernel(
    k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, o_desc,
    beta, rq, rk, gcum, decay, o, h0, ht, h_chunks, cu_seqlens, chunk_start, segments, seg_state,
    T, NT, n_rows, scale,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
    SK: gl.constexpr, SV: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
    L2NORM: gl.constexpr, VARLEN: gl.constexpr, SEG: gl.constexpr, BETA: gl.constexpr,
    STORE_STATES: gl.constexpr, STAGES: gl.constexpr, WARPGROUPS: gl.constexpr, GK: gl.constexpr,
    DELTA: gl.constexpr,
):
    NK: gl.constexpr = K // BK
    # WARPGROUPS warpgroups split the BV columns; each issues its own products on the shared tiles
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WARPGROUPS],
                                                  instr_shape=[16, BV // WARPGROUPS, 16])
    rows: gl.constexpr = gl.SliceLayout(1, acc)
    cols: gl.constexpr = gl.SliceLayout(0, acc)

    i_v, i_hv, i_h, i_s, i_n, bos, eos, first_chunk, c_begin, n_chunks, is_last = _program(
        segments, cu_seqlens, chunk_start, T, NT, H, HV, K, V, BV, VARLEN, SEG)

    r = gl.arange(0, BT, layout=rows)                                       # chunk rows
    o_j = gl.arange(0, BK, layout=rows)                                     # key rows of a state half
    o_v = i_v * BV + gl.arange(0, BV, layout=cols)                          # value columns
    p_half = o_j[:, None] * SK + o_v[None, :] * SV                          # [BK, BV] in one head's state

    S0, S1 = _initial_state(h0, seg_state, i_n, i_s, i_hv, o_j, o_v, p_half, acc, HV, K, V, BV, SK, HAS_H0, SEG)

    tile: gl.constexpr = k_desc.layout
    k_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NK, BT, BK], tile)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NK, BT, BK], tile)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], tile)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], tile)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], v_desc.layout)
    s_s = gl.allocate_shared_memory(gl.bfloat16, [NK, BK, BV], v_desc.layout)     # S (bf16), B operand
    y_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], v_desc.layout)
    vn_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], v_desc.layout)
    if GK:                                  # kd tiles; the update reads V_new itself
        kd_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NK, BT, BK], tile)
        vd_s = vn_s
    else:
        kd_s = k_s
        vd_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], v_desc.layout)
    o_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], o_desc.layout)             # output tile (TMA store)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()

    t_first = (bos + c_begin * BT).to(gl.int32)
    i_hv32 = i_hv.to(gl.int32)
    i_h32 = i_hv32 if GK else i_h.to(gl.int32)                           # the column block of k, q (and kd)
    for st in gl.static_range(STAGES):
        _issue_chunk(k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, bars.index(st),
                     st, t_first + st * BT, i_h32, i_hv32, i_v, st < n_chunks, K, V, BV, NK, GK, DELTA)

    zero = gl.zeros([BT, BV], gl.float32, acc)
    s_s.index(0).store(S0.to(gl.bfloat16))
    if NK == 2:
        s_s.index(1).store(S1.to(gl.bfloat16))
    fence_async_shared()
    # the row vectors are loaded one chunk ahead, so their latency hides behind a chunk's products
    n_G, n_Gl, n_beta, n_rk, n_rq = _chunk_vectors(gcum, beta, rq, rk, r, bos, eos, c_begin, n_chunks > 0,
                                                   i_h, i_hv, H, HV, L2NORM, GK)
    for i in range(0, n_chunks):
        c = c_begin + i
        stage = (i % STAGES).to(gl.int32)
        t0, m_t, b_G, b_Gl, b_beta, b_rk, b_rq, b_dec0, b_dec1, n_G, n_Gl, n_beta, n_rk, n_rq = _chunk_rows(
            gcum, beta, rq, rk, decay, h_chunks, r, o_j, p_half, S0, S1, n_G, n_Gl, n_beta, n_rk, n_rq, bos, eos,
            c, i, n_chunks, first_chunk, i_h, i_hv, H, HV, K, V, SK, L2NORM, BETA, GK, STORE_STATES)

        mbarrier.wait(bars.index(stage), ((i // STAGES) & 1).to(gl.int32))
        S0, S1, out = _chunk_step(k_s, q_s, kd_s, stage * NK, v_s.index(stage), p_s.index(stage), a_s.index(stage),
                                  s_s, 0, y_s, vn_s, vd_s, S0, S1, zero, b_G, b_Gl, b_beta, b_rk, b_rq,
                                  b_dec0, b_dec1, m_t, scale, True, acc, NK, GK, True, DELTA)
        _store_output(out, o_desc, o_s, o, t0, eos, r, o_v, i_hv32, i_v, n_rows, HV, V, BV)
        # the stage is free: chunk i + STAGES into it
        gl.thread_barrier()
        _issue_chunk(k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s,
                     bars.index(stage), stage, (t0 + STAGES * BT).to(gl.int32), i_h32, i_hv32, i_v,
                     i + STAGES < n_chunks, K, V, BV, NK, GK, DELTA)

    tma.store_wait(0)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))
    if STORE_FINAL:
        _store_final(ht, S0, S1, i_n, i_hv, p_half, o_j, is_last, HV, K, V, SK)
