"""Hopper (sm_90) chunk scan of the GDN forward, warp-specialized: the state-independent half of
each chunk step runs a chunk ahead on its own warpgroup.

The math is chunk_delta_sm90.py's, regrouped so that one product per chunk depends on the state:
    V_new = P (beta (v - rk e^G (k S)))
          = U - W S,   U = (P diag(beta)) v,   W = (P diag(beta rk e^G)) k
U and W do not depend on S: the prep partition forms them for chunk i + 1 while the chain
partition steps chunk i.

Inputs as in chunk_delta_sm90.py (same descriptors, prologue and row vectors). Grid
``(sequences or segments x HV x V / BV,)`` (``_program``); 8 warps in two partitions:
  chain (default, warps 0-3; the state S ``[K, BV]`` fp32 in registers as K / 64 halves):
    wait W_i, U_i;  V_new = U - W S  and  Q = q S  issued together; release W_i, U_i
    V_new, D = diag(rk e^(G_last - G)) V_new -> smem
    S = e^G_last S + k^T D  and  O = diag(scale rq e^G) Q + A_qk V_new;  S -> bf16 smem
    release the chunk's slots;  O -> smem -> TMA store (a partial last chunk: masked stores)
  prep (worker, warps 4-7): every TMA load, and per chunk
    P diag(beta), P diag(beta rk e^G) (registers, the A operands)  ->  U = . v,  -W = -(. k)
    -> shared memory, a chunk ahead of the chain.
So the chain waits twice per chunk on products (three times in chunk_delta_sm90.py) and never
issues a TMA load. Load rings: keys three chunks deep (both partitions read them: the prep for
W of chunk i + 1, the chain for S of chunk i), the chain's q and A_qk two, the prep's P and v two;
a chunk's loads wait only on the step before. mbarriers: ``k_loaded`` / ``k_freed`` [3],
``c_loaded`` / ``c_freed`` [2] (chain -> prep: a slot may be refilled), ``p_loaded`` [2] (the prep
refills its own), ``wu_ready`` / ``wu_free`` (W and U, one buffer).

Budget (K = V = 128, sm_90 compile, tests/backends/test_gluon_sm90.py): 200 KB of shared memory
at BV 64, 164 KB at 32; the prep warpgroup at PREP_REGS registers, the chain at 256; no spills.
Measured (docs/notes/gdn-prefill.md, v10): 4-10% slower than chunk_delta_sm90.py at 64 columns on
every swept shape, so opt-in (``SCAN_SPECIALIZED`` in chunk_delta.py).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from fastla.backends.gluon.chunk_delta_sm90 import (
    BK, BT, _initial_state, _inv_norms, _program, _store_final, _store_output,
)
from fastla.backends.triton.chunk_prepare import _activate_beta

PREP_REGS = 232     # registers per thread of the prep warpgroup (setmaxnreg; 192 spills at 64 columns)


@gluon.jit
def _row_vectors(gcum, rq, rk, r, bos, eos, c, valid, i_h, i_hv, H: gl.constexpr, HV: gl.constexpr,
                 L2NORM: gl.constexpr):
    """Chunk c's per-row G, 1/|k|, 1/|q| [BT] and its last row's G (0 where not ``valid``); loaded a
    chunk before their use."""
    t0 = bos + c * BT
    m_t = (r < eos - t0) & valid
    b_G = gl.load(gcum + (t0 + r) * HV + i_hv, mask=m_t, other=0.0)
    b_Gl = gl.load(gcum + (gl.minimum(eos, t0 + BT) - 1) * HV + i_hv, mask=valid, other=0.0)
    b_rk, b_rq = _inv_norms(rq, rk, t0, r, m_t, i_h, H, L2NORM)
    return b_G, b_Gl, b_rk, b_rq


@gluon.jit
def _load_keys(k_desc, k_s, bar, slot, t0, i_h, pred, K: gl.constexpr):
    """TMA loads of one chunk's keys [BT, K] into ``slot`` (K / 64 tiles), completing on ``bar``."""
    NK: gl.constexpr = K // BK
    mbarrier.expect(bar, NK * BT * BK * 2, pred=pred)
    for j in gl.static_range(NK):
        tma.async_copy_global_to_shared(k_desc, [t0, i_h * K + j * BK], bar, k_s.index(slot * NK + j), pred=pred)


@gluon.jit
def _load_chain_tiles(q_desc, a_desc, q_s, a_s, bar, slot, t0, i_h, i_hv, pred, K: gl.constexpr):
    """The chain's tiles of one chunk: queries [BT, K] and scores [BT, BT]."""
    NK: gl.constexpr = K // BK
    mbarrier.expect(bar, (NK * BT * BK + BT * BT) * 2, pred=pred)
    for j in gl.static_range(NK):
        tma.async_copy_global_to_shared(q_desc, [t0, i_h * K + j * BK], bar, q_s.index(slot * NK + j), pred=pred)
    tma.async_copy_global_to_shared(a_desc, [t0, i_hv * BT], bar, a_s.index(slot), pred=pred)


@gluon.jit
def _load_prep_tiles(p_desc, v_desc, p_s, v_s, bar, slot, t0, i_hv, i_v, pred, V: gl.constexpr, BV: gl.constexpr):
    """The prep's tiles of one chunk: P [BT, BT] and the values [BT, BV]."""
    mbarrier.expect(bar, (BT * BT + BT * BV) * 2, pred=pred)
    tma.async_copy_global_to_shared(p_desc, [t0, i_hv * BT], bar, p_s.index(slot), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [t0, i_hv * V + i_v * BV], bar, v_s.index(slot), pred=pred)


@gluon.jit
def _prep_vectors(gcum, beta, rk, r, bos, eos, c, valid, i_h, i_hv, H: gl.constexpr, HV: gl.constexpr,
                  L2NORM: gl.constexpr):
    """Chunk c's G, raw beta and 1/|k| per token (0 where not ``valid``), loaded a chunk ahead."""
    t0 = bos + c * BT
    m_t = (r < eos - t0) & valid
    row = (t0 + r) * HV + i_hv
    b_G = gl.load(gcum + row, mask=m_t, other=0.0)
    b_beta = gl.load(beta + row, mask=m_t, other=0.0)
    if L2NORM:
        b_rk = gl.load(rk + (t0 + r) * H + i_h, mask=m_t, other=0.0)
    else:
        b_rk = gl.where(m_t, 1.0, 0.0)
    return b_G, b_beta, b_rk


@gluon.jit
def _prep_partition(k_desc, q_desc, v_desc, p_desc, a_desc, k_s, q_s, v_s, p_s, a_s, w_s, u_s,
                    k_loaded, k_freed, c_loaded, c_freed, p_loaded, wu_ready, wu_free, beta, rk, gcum,
                    bos, eos, c_begin, n_chunks, i_h, i_hv, i_v,
                    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                    L2NORM: gl.constexpr, BETA: gl.constexpr):
    NK: gl.constexpr = K // BK
    acc_k: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
    acc_v: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    cols: gl.constexpr = gl.SliceLayout(0, acc_k)                           # P's columns: the chunk's tokens
    r = gl.arange(0, BT, layout=cols)
    zero_k = gl.zeros([BT, BK], gl.float32, acc_k)
    zero_v = gl.zeros([BT, BV], gl.float32, acc_v)

    # the rings' first chunks: keys 0-2, the chain's tiles 0-1, P and v 0-1
    t_first = (bos + c_begin * BT).to(gl.int32)
    for c in gl.static_range(3):
        _load_keys(k_desc, k_s, k_loaded.index(c), c, t_first + c * BT, i_h, c < n_chunks, K)
    for c in gl.static_range(2):
        _load_chain_tiles(q_desc, a_desc, q_s, a_s, c_loaded.index(c), c, t_first + c * BT, i_h, i_hv,
                          c < n_chunks, K)
        _load_prep_tiles(p_desc, v_desc, p_s, v_s, p_loaded.index(c), c, t_first + c * BT, i_hv, i_v,
                         c < n_chunks, V, BV)
    n_G, n_beta, n_rk = _prep_vectors(gcum, beta, rk, r, bos, eos, c_begin, n_chunks > 0, i_h, i_hv, H, HV, L2NORM)
    for i in range(0, n_chunks):
        t0 = bos + (c_begin + i) * BT
        m_t = r < eos - t0
        b_G, b_rk = n_G, n_rk
        b_beta = _activate_beta(n_beta, m_t, BETA)
        n_G, n_beta, n_rk = _prep_vectors(gcum, beta, rk, r, bos, eos, c_begin + i + 1, i + 1 < n_chunks,
                                          i_h, i_hv, H, HV, L2NORM)
        ks = (i % 3).to(gl.int32)
        ps = (i % 2).to(gl.int32)
        mbarrier.wait(p_loaded.index(ps), ((i // 2) & 1).to(gl.int32))
        mbarrier.wait(k_loaded.index(ks), ((i // 3) & 1).to(gl.int32))
        # P's columns scaled: the A operands of U and W, in registers
        b_p = p_s.index(ps).load(acc_k).to(gl.float32)                      # [BT, BT]
        p_w = gl.convert_layout((b_p * (b_beta * b_rk * gl.exp(b_G))[None, :]).to(gl.bfloat16),
                                gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2))
        p_u = gl.convert_layout((b_p * b_beta[None, :]).to(gl.bfloat16),
                                gl.DotOperandLayout(operand_index=0, parent=acc_v, k_width=2))
        u = warpgroup_mma(p_u, v_s.index(ps), zero_v, use_acc=False, is_async=True)
        w0 = warpgroup_mma(p_w, k_s.index(ks * NK), zero_k, use_acc=False, is_async=True)
        if NK == 2:
            w1 = warpgroup_mma(p_w, k_s.index(ks * NK + 1), zero_k, use_acc=False, is_async=True)
            u, w0, w1 = warpgroup_mma_wait(num_outstanding=0, deps=(u, w0, w1))
        else:
            u, w0 = warpgroup_mma_wait(num_outstanding=0, deps=(u, w0))
        # P and v of chunk i read: chunk i + 2's into their slot
        fence_async_shared()
        _load_prep_tiles(p_desc, v_desc, p_s, v_s, p_loaded.index(ps), ps, (t0 + 2 * BT).to(gl.int32), i_hv, i_v,
                         i + 2 < n_chunks, V, BV)
        # W and U into their buffer once the chain has used chunk i - 1's
        mbarrier.wait(wu_free, ((i & 1) ^ 1).to(gl.int32))
        u_s.store(u)
        w_s.index(0).store((-w0).to(gl.bfloat16))
        if NK == 2:
            w_s.index(1).store((-w1).to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(wu_ready, count=1)
        # the chain is done with chunk i - 1 (after its step i - 1): keys of chunk i + 2 and the
        # chain's tiles of chunk i + 1 into the slots it held
        if i > 0:
            mbarrier.wait(k_freed.index(((i - 1) % 3).to(gl.int32)), (((i - 1) // 3) & 1).to(gl.int32))
            _load_keys(k_desc, k_s, k_loaded.index(((i + 2) % 3).to(gl.int32)), ((i + 2) % 3).to(gl.int32),
                       (t0 + 2 * BT).to(gl.int32), i_h, i + 2 < n_chunks, K)
            cs = ((i + 1) % 2).to(gl.int32)
            mbarrier.wait(c_freed.index(cs), (((i - 1) // 2) & 1).to(gl.int32))
            _load_chain_tiles(q_desc, a_desc, q_s, a_s, c_loaded.index(cs), cs, (t0 + BT).to(gl.int32), i_h, i_hv,
                              i + 1 < n_chunks, K)


@gluon.jit
def _chain_partition(k_s, q_s, a_s, s_s, w_s, u_s, vn_s, vd_s, o_s, k_loaded, k_freed, c_loaded, c_freed,
                     wu_ready, wu_free, o_desc,
                     rq, rk, gcum, o, h0, ht, h_chunks, seg_state, bos, eos, c_begin, n_chunks, first_chunk,
                     is_last, i_n, i_s, i_h, i_hv, i_v, n_rows, scale,
                     H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                     SK: gl.constexpr, SV: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
                     L2NORM: gl.constexpr, SEG: gl.constexpr, STORE_STATES: gl.constexpr):
    NK: gl.constexpr = K // BK
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    rows: gl.constexpr = gl.SliceLayout(1, acc)
    cols: gl.constexpr = gl.SliceLayout(0, acc)
    r = gl.arange(0, BT, layout=rows)                                       # chunk rows
    o_j = gl.arange(0, BK, layout=rows)                                     # key rows of a state half
    o_v = i_v * BV + gl.arange(0, BV, layout=cols)                          # value columns
    p_half = o_j[:, None] * SK + o_v[None, :] * SV                          # [BK, BV] in one head's state

    S0, S1 = _initial_state(h0, seg_state, i_n, i_s, i_hv, o_j, o_v, p_half, acc, HV, K, V, BV, SK, HAS_H0, SEG)
    s_s.index(0).store(S0.to(gl.bfloat16))
    if NK == 2:
        s_s.index(1).store(S1.to(gl.bfloat16))
    fence_async_shared()

    zero = gl.zeros([BT, BV], gl.float32, acc)
    n_G, n_Gl, n_rk, n_rq = _row_vectors(gcum, rq, rk, r, bos, eos, c_begin, n_chunks > 0, i_h, i_hv, H, HV, L2NORM)
    for i in range(0, n_chunks):
        c = c_begin + i
        ks = (i % 3).to(gl.int32)
        cs = (i % 2).to(gl.int32)
        t0 = bos + c * BT
        m_t = r < eos - t0
        b_G, b_Gl, b_rk, b_rq = n_G, n_Gl, n_rk, n_rq
        n_G, n_Gl, n_rk, n_rq = _row_vectors(gcum, rq, rk, r, bos, eos, c + 1, i + 1 < n_chunks, i_h, i_hv,
                                             H, HV, L2NORM)
        if STORE_STATES:
            h_base = h_chunks + ((first_chunk + c) * HV + i_hv) * K * V + p_half
            gl.store(h_base, S0.to(h_chunks.dtype.element_ty))
            if NK == 2:
                gl.store(h_base + BK * SK, S1.to(h_chunks.dtype.element_ty))

        # V_new = U - W S  and  Q = q S
        mbarrier.wait(c_loaded.index(cs), ((i // 2) & 1).to(gl.int32))
        mbarrier.wait(wu_ready, (i & 1).to(gl.int32))
        vn = warpgroup_mma(w_s.index(0), s_s.index(0), u_s.load(acc), is_async=True)
        if NK == 2:
            vn = warpgroup_mma(w_s.index(1), s_s.index(1), vn, is_async=True)
        qs = warpgroup_mma(q_s.index(cs * NK), s_s.index(0), zero, use_acc=False, is_async=True)
        if NK == 2:
            qs = warpgroup_mma(q_s.index(cs * NK + 1), s_s.index(1), qs, is_async=True)
        vn = warpgroup_mma_wait(num_outstanding=NK, deps=(vn,))
        mbarrier.arrive(wu_free, count=1)
        # O = diag(scale rq e^G) Q + A_qk V_new;  S = e^G_last S + k^T diag(rk e^(G_last - G)) V_new
        b_d = gl.where(m_t, b_rk * gl.exp(b_Gl - b_G), 0.0)
        vn_s.store(vn.to(gl.bfloat16))
        vd_s.store((vn * b_d[:, None]).to(gl.bfloat16))
        fence_async_shared()
        b_egl = gl.exp(b_Gl)
        qs = warpgroup_mma_wait(num_outstanding=0, deps=(qs,))
        mbarrier.wait(k_loaded.index(ks), ((i // 3) & 1).to(gl.int32))
        S0 = warpgroup_mma(k_s.index(ks * NK).permute((1, 0)), vd_s, S0 * b_egl, is_async=True)
        if NK == 2:
            S1 = warpgroup_mma(k_s.index(ks * NK + 1).permute((1, 0)), vd_s, S1 * b_egl, is_async=True)
        out = warpgroup_mma(a_s.index(cs), vn_s, qs * (scale * b_rq * gl.exp(b_G))[:, None], is_async=True)
        # the state first (the output's product runs on): S -> bf16 smem for the next chunk's products
        if NK == 2:
            S0, S1 = warpgroup_mma_wait(num_outstanding=1, deps=(S0, S1))
            s_s.index(1).store(S1.to(gl.bfloat16))
        else:
            S0 = warpgroup_mma_wait(num_outstanding=1, deps=(S0,))
        mbarrier.arrive(k_freed.index(ks), count=1)
        s_s.index(0).store(S0.to(gl.bfloat16))
        fence_async_shared()
        out = warpgroup_mma_wait(num_outstanding=0, deps=(out,))
        mbarrier.arrive(c_freed.index(cs), count=1)
        _store_output(out, o_desc, o_s, o, t0, eos, r, o_v, i_hv, i_v, n_rows, HV, V, BV)

    tma.store_wait(0)
    if STORE_FINAL:
        _store_final(ht, S0, S1, i_n, i_hv, p_half, o_j, is_last, HV, K, V, SK)


@gluon.jit(do_not_specialize=["T", "NT", "n_rows"])
def _scan_ws_sm90_kernel(
    k_desc, q_desc, v_desc, p_desc, a_desc, o_desc,
    beta, rq, rk, gcum, o, h0, ht, h_chunks, cu_seqlens, chunk_start, segments, seg_state,
    T, NT, n_rows, scale,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
    SK: gl.constexpr, SV: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
    L2NORM: gl.constexpr, VARLEN: gl.constexpr, SEG: gl.constexpr, BETA: gl.constexpr,
    STORE_STATES: gl.constexpr, PREP_NREG: gl.constexpr,
):
    NK: gl.constexpr = K // BK
    i_v, i_hv, i_h, i_s, i_n, bos, eos, first_chunk, c_begin, n_chunks, is_last = _program(
        segments, cu_seqlens, chunk_start, T, NT, H, HV, K, V, BV, VARLEN, SEG)

    tile: gl.constexpr = k_desc.layout
    k_s = gl.allocate_shared_memory(gl.bfloat16, [3 * NK, BT, BK], tile)        # keys: three chunks
    q_s = gl.allocate_shared_memory(gl.bfloat16, [2 * NK, BT, BK], tile)        # the chain's: two
    a_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BT], tile)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BT], tile)             # the prep's: two
    v_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BV], v_desc.layout)
    w_s = gl.allocate_shared_memory(gl.bfloat16, [NK, BT, BK], tile)            # -W (A operand)
    u_s = gl.allocate_shared_memory(gl.float32, [BT, BV], gl.NVMMASharedLayout.get_default_for([BT, BV], gl.float32))
    s_s = gl.allocate_shared_memory(gl.bfloat16, [NK, BK, BV], v_desc.layout)  # S (bf16), B operand
    vn_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], v_desc.layout)
    vd_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], v_desc.layout)
    o_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], o_desc.layout)      # output tile (TMA store)
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    k_loaded = gl.allocate_shared_memory(gl.int64, [3, 1], bar)
    k_freed = gl.allocate_shared_memory(gl.int64, [3, 1], bar)
    c_loaded = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    c_freed = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    p_loaded = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    wu_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
    wu_free = gl.allocate_shared_memory(gl.int64, [1], bar)
    for j in gl.static_range(3):
        mbarrier.init(k_loaded.index(j), count=1)
        mbarrier.init(k_freed.index(j), count=1)
    for j in gl.static_range(2):
        mbarrier.init(c_loaded.index(j), count=1)
        mbarrier.init(c_freed.index(j), count=1)
        mbarrier.init(p_loaded.index(j), count=1)
    mbarrier.init(wu_ready, count=1)
    mbarrier.init(wu_free, count=1)
    fence_async_shared()

    i_h32 = i_h.to(gl.int32)
    i_hv32 = i_hv.to(gl.int32)
    gl.warp_specialize([
        (_chain_partition, (k_s, q_s, a_s, s_s, w_s, u_s, vn_s, vd_s, o_s, k_loaded, k_freed, c_loaded, c_freed,
                            wu_ready, wu_free, o_desc, rq, rk, gcum, o, h0, ht, h_chunks, seg_state,
                            bos, eos, c_begin, n_chunks, first_chunk, is_last, i_n, i_s, i_h, i_hv32, i_v, n_rows,
                            scale, H, HV, K, V, BV, SK, SV, HAS_H0, STORE_FINAL, L2NORM, SEG, STORE_STATES)),
        (_prep_partition, (k_desc, q_desc, v_desc, p_desc, a_desc, k_s, q_s, v_s, p_s, a_s, w_s, u_s,
                           k_loaded, k_freed, c_loaded, c_freed, p_loaded, wu_ready, wu_free, beta, rk, gcum,
                           bos, eos, c_begin, n_chunks, i_h32, i_hv32, i_v, H, HV, K, V, BV, L2NORM, BETA)),
    ], [4], [PREP_NREG])
