"""Hopper (sm_90) chunk scan of the GDN forward, warp-specialized: the state-independent half of
each chunk step runs a chunk ahead on its own warpgroup.

The math is chunk_delta_sm90.py's, regrouped so that one product per chunk depends on the state:
    V_new = P (beta (v - rk e^G (k S)))
          = U - W S,   U = (P diag(beta)) v,   W = (P diag(beta rk e^G)) k
U and W do not depend on S: the prep partition forms them for chunk i + 1 while the chain
partition steps chunk i.

Inputs as in chunk_delta_sm90.py (same descriptors, prologue and row vectors). Grid
``(sequences or segments x HV, V / BV)``; 8 warps in two partitions:
  chain (default, warps 0-3; the state S ``[K, BV]`` fp32 in registers as K / 64 halves):
    wait W_i, U_i;  V_new = U - W S  and  Q = q S  issued together; release W_i, U_i
    V_new, D = diag(rk e^(G_last - G)) V_new -> smem
    S = e^G_last S + k^T D  and  O = diag(scale rq e^G) Q + A_qk V_new;  S -> bf16 smem
    release the chunk's stage;  O -> smem -> TMA store (a partial last chunk: masked stores)
  prep (worker, warps 4-7): the TMA loads of STAGES chunks in flight, and per chunk
    P diag(beta), P diag(beta rk e^G) (registers, the A operands)  ->  U = . v,  -W = -(. k)
    -> shared memory (two buffers), a chunk ahead of the chain.
So the chain waits twice per chunk on products (three times in chunk_delta_sm90.py) and never
issues a TMA load. mbarriers: ``loaded[s]`` (TMA -> both), ``freed[s]`` (chain -> prep: stage s
may be refilled), ``wu_ready[b]`` / ``wu_free[b]`` (prep <-> chain, W and U buffer b).

Budget (K = V = 128, STAGES = 2, sm_90 compile): see tests/backends/test_gluon_sm90.py; BV 64
needs ~216 KB of shared memory (W bf16 and U fp32 double-buffered), so 128 columns do not fit.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from fastla.backends.gluon.chunk_delta_sm90 import BK, BT, _issue_chunk
from fastla.backends.triton.chunk_index import _sequence
from fastla.backends.triton.chunk_prepare import _activate_beta

PREP_REGS = 192     # registers per thread of the prep warpgroup (setmaxnreg)


@gluon.jit
def _row_vectors(gcum, rq, rk, r, bos, eos, c, valid, i_h, i_hv, H: gl.constexpr, HV: gl.constexpr,
                 L2NORM: gl.constexpr):
    """Chunk c's per-row G, 1/|k|, 1/|q| [BT] and its last row's G (0 where not ``valid``); loaded a
    chunk before their use."""
    t0 = bos + c * BT
    m_t = (r < eos - t0) & valid
    b_G = gl.load(gcum + (t0 + r) * HV + i_hv, mask=m_t, other=0.0)
    b_Gl = gl.load(gcum + (gl.minimum(eos, t0 + BT) - 1) * HV + i_hv, mask=valid, other=0.0)
    if L2NORM:
        b_rk = gl.load(rk + (t0 + r) * H + i_h, mask=m_t, other=0.0)
        b_rq = gl.load(rq + (t0 + r) * H + i_h, mask=m_t, other=0.0)
    else:
        b_rk = gl.where(m_t, 1.0, 0.0)
        b_rq = b_rk
    return b_G, b_Gl, b_rk, b_rq


@gluon.jit
def _prep_partition(k_desc, q_desc, v_desc, p_desc, a_desc, k_s, q_s, v_s, p_s, a_s, w_s, u_s,
                    loaded, freed, wu_ready, wu_free, beta, rk, gcum, bos, eos, c_begin, n_chunks, i_h, i_hv, i_v,
                    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                    L2NORM: gl.constexpr, BETA: gl.constexpr, STAGES: gl.constexpr):
    NK: gl.constexpr = K // BK
    acc_k: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
    acc_v: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    cols: gl.constexpr = gl.SliceLayout(0, acc_k)                           # P's columns: the chunk's tokens
    r = gl.arange(0, BT, layout=cols)
    zero_k = gl.zeros([BT, BK], gl.float32, acc_k)
    zero_v = gl.zeros([BT, BV], gl.float32, acc_v)

    t_first = (bos + c_begin * BT).to(gl.int32)
    for st in gl.static_range(STAGES):
        _issue_chunk(k_desc, q_desc, v_desc, p_desc, a_desc, k_s, q_s, v_s, p_s, a_s, loaded.index(st), st,
                     t_first + st * BT, i_h, i_hv, i_v, st < n_chunks, K, V, BV, NK)
    for i in range(0, n_chunks):
        stage = (i % STAGES).to(gl.int32)
        t0 = bos + (c_begin + i) * BT
        m_t = r < eos - t0
        row = (t0 + r) * HV + i_hv
        b_beta = _activate_beta(gl.load(beta + row, mask=m_t, other=0.0), m_t, BETA)
        b_G = gl.load(gcum + row, mask=m_t, other=0.0)
        if L2NORM:
            b_rk = gl.load(rk + (t0 + r) * H + i_h, mask=m_t, other=0.0)
        else:
            b_rk = gl.where(m_t, 1.0, 0.0)
        mbarrier.wait(loaded.index(stage), ((i // STAGES) & 1).to(gl.int32))
        # P's columns scaled: the A operands of U and W, in registers
        b_p = p_s.index(stage).load(acc_k).to(gl.float32)                   # [BT, BT]
        p_w = gl.convert_layout((b_p * (b_beta * b_rk * gl.exp(b_G))[None, :]).to(gl.bfloat16),
                                gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2))
        p_u = gl.convert_layout((b_p * b_beta[None, :]).to(gl.bfloat16),
                                gl.DotOperandLayout(operand_index=0, parent=acc_v, k_width=2))
        u = warpgroup_mma(p_u, v_s.index(stage), zero_v, use_acc=False, is_async=True)
        w0 = warpgroup_mma(p_w, k_s.index(stage * NK), zero_k, use_acc=False, is_async=True)
        if NK == 2:
            w1 = warpgroup_mma(p_w, k_s.index(stage * NK + 1), zero_k, use_acc=False, is_async=True)
            u, w0, w1 = warpgroup_mma_wait(num_outstanding=0, deps=(u, w0, w1))
        else:
            u, w0 = warpgroup_mma_wait(num_outstanding=0, deps=(u, w0))
        # into buffer i % 2 once the chain has used chunk i - 2's
        buf = (i % 2).to(gl.int32)
        mbarrier.wait(wu_free.index(buf), (((i // 2) & 1) ^ 1).to(gl.int32))
        u_s.index(buf).store(u)
        w_s.index(buf * NK).store((-w0).to(gl.bfloat16))
        if NK == 2:
            w_s.index(buf * NK + 1).store((-w1).to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(wu_ready.index(buf), count=1)
        # chunk i - 1's stage, once the chain is done with it: chunk i - 1 + STAGES into it
        if i > 0:
            prev = ((i - 1) % STAGES).to(gl.int32)
            mbarrier.wait(freed.index(prev), (((i - 1) // STAGES) & 1).to(gl.int32))
            _issue_chunk(k_desc, q_desc, v_desc, p_desc, a_desc, k_s, q_s, v_s, p_s, a_s, loaded.index(prev), prev,
                         (t0 + (STAGES - 1) * BT).to(gl.int32), i_h, i_hv, i_v, i - 1 + STAGES < n_chunks,
                         K, V, BV, NK)


@gluon.jit
def _chain_partition(k_s, q_s, a_s, s_s, w_s, u_s, vn_s, vd_s, o_s, loaded, freed, wu_ready, wu_free, o_desc,
                     rq, rk, gcum, o, h0, ht, h_chunks, seg_state, bos, eos, c_begin, n_chunks, first_chunk,
                     is_last, i_n, i_s, i_h, i_hv, i_v, n_rows, scale,
                     H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                     SK: gl.constexpr, SV: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
                     L2NORM: gl.constexpr, SEG: gl.constexpr, STORE_STATES: gl.constexpr, STAGES: gl.constexpr):
    NK: gl.constexpr = K // BK
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    rows: gl.constexpr = gl.SliceLayout(1, acc)
    cols: gl.constexpr = gl.SliceLayout(0, acc)
    r = gl.arange(0, BT, layout=rows)                                       # chunk rows
    o_j = gl.arange(0, BK, layout=rows)                                     # key rows of a state half
    o_v = i_v * BV + gl.arange(0, BV, layout=cols)                          # value columns
    p_half = o_j[:, None] * SK + o_v[None, :] * SV                          # [BK, BV] in one head's state

    # the state halves [BK, BV] fp32 (key rows j * 64 ..)
    S0 = gl.zeros([BK, BV], gl.float32, acc)
    S1 = gl.zeros([BK, BV], gl.float32, acc)
    if SEG == 2:
        seg_base = seg_state + (i_s * HV + i_hv) * K * V + o_j[:, None] * V + o_v[None, :]
        S0 = gl.load(seg_base)
        if NK == 2:
            S1 = gl.load(seg_base + BK * V)
    elif HAS_H0:
        h0_base = h0 + (i_n * HV + i_hv) * K * V + p_half
        S0 = gl.load(h0_base).to(gl.float32)
        if NK == 2:
            S1 = gl.load(h0_base + BK * SK).to(gl.float32)
    s_s.index(0).store(S0.to(gl.bfloat16))
    if NK == 2:
        s_s.index(1).store(S1.to(gl.bfloat16))
    fence_async_shared()

    zero = gl.zeros([BT, BV], gl.float32, acc)
    n_G, n_Gl, n_rk, n_rq = _row_vectors(gcum, rq, rk, r, bos, eos, c_begin, n_chunks > 0, i_h, i_hv, H, HV, L2NORM)
    for i in range(0, n_chunks):
        c = c_begin + i
        stage = (i % STAGES).to(gl.int32)
        buf = (i % 2).to(gl.int32)
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
        mbarrier.wait(loaded.index(stage), ((i // STAGES) & 1).to(gl.int32))
        mbarrier.wait(wu_ready.index(buf), ((i // 2) & 1).to(gl.int32))
        vn = warpgroup_mma(w_s.index(buf * NK), s_s.index(0), u_s.index(buf).load(acc), is_async=True)
        if NK == 2:
            vn = warpgroup_mma(w_s.index(buf * NK + 1), s_s.index(1), vn, is_async=True)
        qs = warpgroup_mma(q_s.index(stage * NK), s_s.index(0), zero, use_acc=False, is_async=True)
        if NK == 2:
            qs = warpgroup_mma(q_s.index(stage * NK + 1), s_s.index(1), qs, is_async=True)
        vn = warpgroup_mma_wait(num_outstanding=NK, deps=(vn,))
        mbarrier.arrive(wu_free.index(buf), count=1)
        # O = diag(scale rq e^G) Q + A_qk V_new;  S = e^G_last S + k^T diag(rk e^(G_last - G)) V_new
        b_d = gl.where(m_t, b_rk * gl.exp(b_Gl - b_G), 0.0)
        vn_s.store(vn.to(gl.bfloat16))
        vd_s.store((vn * b_d[:, None]).to(gl.bfloat16))
        fence_async_shared()
        b_egl = gl.exp(b_Gl)
        qs = warpgroup_mma_wait(num_outstanding=0, deps=(qs,))
        S0 = warpgroup_mma(k_s.index(stage * NK).permute((1, 0)), vd_s, S0 * b_egl, is_async=True)
        if NK == 2:
            S1 = warpgroup_mma(k_s.index(stage * NK + 1).permute((1, 0)), vd_s, S1 * b_egl, is_async=True)
        out = warpgroup_mma(a_s.index(stage), vn_s, qs * (scale * b_rq * gl.exp(b_G))[:, None], is_async=True)
        # the state first (the output's product runs on): S -> bf16 smem for the next chunk's products
        if NK == 2:
            S0, S1 = warpgroup_mma_wait(num_outstanding=1, deps=(S0, S1))
            s_s.index(1).store(S1.to(gl.bfloat16))
        else:
            S0 = warpgroup_mma_wait(num_outstanding=1, deps=(S0,))
        s_s.index(0).store(S0.to(gl.bfloat16))
        fence_async_shared()
        out = warpgroup_mma_wait(num_outstanding=0, deps=(out,))
        mbarrier.arrive(freed.index(stage), count=1)
        # the output: a whole chunk by a TMA store from shared memory; a sequence's partial last
        # chunk by masked stores, its tile sent past the last row (TMA writes nothing out of bounds)
        whole = eos - t0 >= BT
        tma.store_wait(0)
        gl.thread_barrier()
        o_s.store(out.to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [gl.where(whole, t0, n_rows).to(gl.int32), i_hv * V + i_v * BV], o_s)
        o_ptr = o + ((t0 + r) * HV + i_hv)[:, None] * V + o_v[None, :]
        gl.store(o_ptr, out.to(o.dtype.element_ty), mask=m_t[:, None] & (eos - t0 < BT))

    tma.store_wait(0)
    if STORE_FINAL:
        ht_base = ht + (i_n * HV + i_hv) * K * V + p_half
        m_last = (o_j >= 0)[:, None] & is_last                              # segments: the last one only
        gl.store(ht_base, S0.to(ht.dtype.element_ty), mask=m_last)
        if NK == 2:
            gl.store(ht_base + BK * SK, S1.to(ht.dtype.element_ty), mask=m_last)


@gluon.jit(do_not_specialize=["T", "NT", "n_rows"])
def _scan_ws_sm90_kernel(
    k_desc, q_desc, v_desc, p_desc, a_desc, o_desc,
    beta, rq, rk, gcum, o, h0, ht, h_chunks, cu_seqlens, chunk_start, segments, seg_state,
    T, NT, n_rows, scale,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
    SK: gl.constexpr, SV: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
    L2NORM: gl.constexpr, VARLEN: gl.constexpr, SEG: gl.constexpr, BETA: gl.constexpr,
    STORE_STATES: gl.constexpr, STAGES: gl.constexpr, PREP_NREG: gl.constexpr,
):
    NK: gl.constexpr = K // BK
    i_p = gl.program_id(0).to(gl.int64)
    i_v = gl.program_id(1)
    i_hv = i_p % HV
    i_h = i_hv // (HV // H)
    i_s = i_p // HV
    if SEG == 0:
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

    tile: gl.constexpr = k_desc.layout
    k_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NK, BT, BK], tile)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NK, BT, BK], tile)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], tile)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], tile)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], v_desc.layout)
    w_s = gl.allocate_shared_memory(gl.bfloat16, [2 * NK, BT, BK], tile)                 # -W, two buffers
    u_s = gl.allocate_shared_memory(gl.float32, [2, BT, BV],
                                    gl.NVMMASharedLayout.get_default_for([BT, BV], gl.float32))
    s_s = gl.allocate_shared_memory(gl.bfloat16, [NK, BK, BV], v_desc.layout)          # S (bf16), B operand
    vn_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], v_desc.layout)
    vd_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], v_desc.layout)
    o_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], o_desc.layout)              # output tile (TMA store)
    loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    freed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    wu_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    wu_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(loaded.index(st), count=1)
        mbarrier.init(freed.index(st), count=1)
    for b in gl.static_range(2):
        mbarrier.init(wu_ready.index(b), count=1)
        mbarrier.init(wu_free.index(b), count=1)
    fence_async_shared()

    i_h32 = i_h.to(gl.int32)
    i_hv32 = i_hv.to(gl.int32)
    gl.warp_specialize([
        (_chain_partition, (k_s, q_s, a_s, s_s, w_s, u_s, vn_s, vd_s, o_s, loaded, freed, wu_ready, wu_free, o_desc,
                            rq, rk, gcum, o, h0, ht, h_chunks, seg_state, bos, eos, c_begin, n_chunks, first_chunk,
                            is_last, i_n, i_s, i_h, i_hv32, i_v, n_rows, scale,
                            H, HV, K, V, BV, SK, SV, HAS_H0, STORE_FINAL, L2NORM, SEG, STORE_STATES, STAGES)),
        (_prep_partition, (k_desc, q_desc, v_desc, p_desc, a_desc, k_s, q_s, v_s, p_s, a_s, w_s, u_s,
                           loaded, freed, wu_ready, wu_free, beta, rk, gcum, bos, eos, c_begin, n_chunks,
                           i_h32, i_hv32, i_v, H, HV, K, V, BV, L2NORM, BETA, STAGES)),
    ], [4], [PREP_NREG])
