"""Hopper (sm_90) chunk scan of the GDN and KDA forwards on two independent chains per program.

The step is chunk_delta_sm90.py's (same prologue, descriptors and row vectors); what changes is
who waits on whom. A program owns BV value columns of one value head; two chain partitions
(4 warps each) step the two halves of BV / 2 columns, each its own state ``[K, BV / 2]`` fp32 in
registers, and a one-warp loader partition issues every TMA load. The chains share the chunk's
key, query (kd) and P / A_qk tiles and read their own value tile; they synchronize only through
the stage mbarriers (``loaded[s]``: the loader's expect-tx; ``freed[s]``: count 2, one arrive per
chain when its products on the stage are done), so one chain's products run while the other
waits on its own: a chain's barriers are named barriers of its 4 warps, where the plain kernel's
two warpgroups (WARPGROUPS = 2) meet at every CTA-wide barrier of the step (15 a chunk).

Grid ``(sequences or segments x HV x V / BV,)`` (``_program``); 9 warps: chain 0 (default
partition, warps 0-3), chain 1 (warps 4-7), the loader (warp 8). Chain c covers the columns of value tile
``2 i_v + c`` of width BV / 2: its output tile, value tile and state columns are the plain
kernel's for that tile.

Budget (K = V = 128, two stages, sm_90 compile; tests/backends/test_gluon_sm90.py): 384 threads
at 168 registers, redistributed by setmaxnreg: chain 0 224, chain 1 CHAIN_REGS (248), the loader's
warpgroup LOADER_REGS; shared memory 128 KB at BV 32, 160 KB at 64 (184 KB with KDA's kd tiles),
224 KB at 128, one program per SM; no spills except 64 bytes at 128 columns (values computed
before the fork, reloaded once and once a step). Measured (H200, docs/notes/gdn-prefill.md v11):
a step 14% shorter than the one-chain kernel's at 64 and 128 columns (1x32k HV64 scan 1142 -> 981
us; 4x8k HV32 411 -> 354), 6-10% at 32, 15% on KDA's 64 (1x8k H64 345 -> 294 us); KDA at 32
columns (two chains of 16) lost 35% and runs the one-chain kernel. A fourth partition forming
GDN's causal scores from the stage's tiles (instead of the prologue's scores kernel) was correct
but lengthened the step by ~1 us (notes v13; branch wip/scan-scores).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from fastla.backends.gluon.chunk_delta_sm90 import (
    BK, BT, _chunk_rows, _chunk_step, _chunk_vectors, _initial_state, _program, _store_final, _store_half_pair,
    _store_output,
)

CHAIN_REGS = 248        # registers per thread of chain 1 (setmaxnreg)
LOADER_REGS = 32        # of the loader's warpgroup (chain 0 gets the rest: 128 x (224 + 248 + 32) = 384 x 168)


@gluon.jit
def _load_stage(k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, loaded, freed,
                i, bos, c_begin, i_h, i_hv, i_v, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                STAGES: gl.constexpr, GK: gl.constexpr, SEG: gl.constexpr, DELTA: gl.constexpr, CHAINS: gl.constexpr,
                SCORES: gl.constexpr = True, QKD: gl.constexpr = True):
    """Chunk i's tiles into stage i % STAGES once every chain has freed it (chunk i - STAGES), a value
    tile of BV / CHAINS columns per chain; returns the stage. A segment summary (SEG 1) loads no
    queries nor scores, and the value tiles of its identity columns (past V) from column 0 of the
    head (read as zeros by the chains). DELTA False (the plain rule): no P, and with GK no gated
    keys (the update reads kd). SCORES False: no A_qk tile (the chains form the scores). Keys and
    queries are those of head i_h, the kd tiles (GK) of value head i_hv. QKD False: none of the key,
    query and kd tiles (another ring holds them: chunk_delta_regs_sm90's GATES)."""
    NK: gl.constexpr = K // BK
    BVC: gl.constexpr = BV // CHAINS
    OUTPUT: gl.constexpr = SEG != 1
    LOAD_A: gl.constexpr = OUTPUT and SCORES
    LOAD_K: gl.constexpr = DELTA or not GK
    n_qk: gl.constexpr = ((1 if OUTPUT else 0) + (1 if GK else 0) + (1 if LOAD_K else 0)) if QKD else 0
    n_sq: gl.constexpr = (1 if LOAD_A else 0) + (1 if DELTA else 0)               # A_qk and P tiles
    nbytes: gl.constexpr = (n_qk * NK * BT * BK + BT * BV + n_sq * BT * BT) * 2
    stage = (i % STAGES).to(gl.int32)
    mbarrier.wait(freed.index(stage), (((i // STAGES) & 1) ^ 1).to(gl.int32))
    t0 = (bos + (c_begin + i) * BT).to(gl.int32)
    bar = loaded.index(stage)
    mbarrier.expect(bar, nbytes)
    for j in gl.static_range(NK if QKD else 0):
        if LOAD_K:
            tma.async_copy_global_to_shared(k_desc, [t0, i_h * K + j * BK], bar, k_s.index(stage * NK + j))
        if OUTPUT:
            tma.async_copy_global_to_shared(q_desc, [t0, i_h * K + j * BK], bar, q_s.index(stage * NK + j))
        if GK:
            tma.async_copy_global_to_shared(kd_desc, [t0, i_hv * K + j * BK], bar, kd_s.index(stage * NK + j))
    for ch in gl.static_range(CHAINS):
        if OUTPUT:
            col = i_hv * V + i_v * BV + ch * BVC
        else:
            col = i_v * BV + ch * BVC
            col = i_hv * V + gl.where(col < V, col, 0)
        tma.async_copy_global_to_shared(v_desc, [t0, col], bar, v_s.index(stage * CHAINS + ch))
    if DELTA:
        tma.async_copy_global_to_shared(p_desc, [t0, i_hv * BT], bar, p_s.index(stage))
    if LOAD_A:
        tma.async_copy_global_to_shared(a_desc, [t0, i_hv * BT], bar, a_s.index(stage))
    return stage


@gluon.jit
def _loader_partition(k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s,
                      loaded, freed, bos, c_begin, n_chunks, i_h, i_hv, i_v,
                      K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, GK: gl.constexpr,
                      SEG: gl.constexpr, DELTA: gl.constexpr):
    """Every chunk's tiles, two chains' value tiles a stage (``_load_stage``)."""
    for i in range(0, n_chunks):
        _load_stage(k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, loaded, freed,
                    i, bos, c_begin, i_h, i_hv, i_v, K, V, BV, STAGES, GK, SEG, DELTA, 2)


@gluon.jit
def _chain_partition(CH: gl.constexpr, k_s, q_s, kd_s, v_s, p_s, a_s, s_s, y_s, vn_s, vd_s, o_s, loaded, freed,
                     o_desc, beta, rq, rk, gcum, decay, o, h0, ht, h_chunks, seg_state,
                     bos, eos, c_begin, n_chunks, first_chunk, is_last, i_n, i_s, i_h, i_hv, i_v, n_rows, scale,
                     H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                     SK: gl.constexpr, SV: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
                     L2NORM: gl.constexpr, BETA: gl.constexpr, SEG: gl.constexpr, STORE_STATES: gl.constexpr,
                     STAGES: gl.constexpr, GK: gl.constexpr, DELTA: gl.constexpr):
    """Chain CH: the columns of value tile 2 i_v + CH (width BV / 2), chunk by chunk."""
    NK: gl.constexpr = K // BK
    BVC: gl.constexpr = BV // 2
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BVC, 16])
    rows: gl.constexpr = gl.SliceLayout(1, acc)
    cols: gl.constexpr = gl.SliceLayout(0, acc)
    tile_v = i_v * 2 + CH                                                   # this chain's value tile
    r = gl.arange(0, BT, layout=rows)                                       # chunk rows
    o_j = gl.arange(0, BK, layout=rows)                                     # key rows of a state half
    o_v = tile_v * BVC + gl.arange(0, BVC, layout=cols)                     # value columns
    p_half = o_j[:, None] * SK + o_v[None, :] * SV                          # [BK, BVC] in one head's state

    S0, S1 = _initial_state(h0, seg_state, i_n, i_s, i_hv, o_j, o_v, p_half, acc, HV, K, V, BVC, SK, HAS_H0, SEG)
    y_t = y_s.index(CH)
    vn_t = vn_s.index(CH)
    vd_t = vd_s.index(CH)
    s_s.index(CH * NK).store(S0.to(gl.bfloat16))                           # S (bf16), B operand: [BK, BVC] halves
    if NK == 2:
        s_s.index(CH * NK + 1).store(S1.to(gl.bfloat16))
    fence_async_shared()

    zero = gl.zeros([BT, BVC], gl.float32, acc)
    n_G, n_Gl, n_beta, n_rk, n_rq = _chunk_vectors(gcum, beta, rq, rk, r, bos, eos, c_begin, n_chunks > 0,
                                                   i_h, i_hv, H, HV, L2NORM, GK)
    for i in range(0, n_chunks):
        c = c_begin + i
        stage = (i % STAGES).to(gl.int32)
        t0, m_t, b_G, b_Gl, b_beta, b_rk, b_rq, b_dec0, b_dec1, n_G, n_Gl, n_beta, n_rk, n_rq = _chunk_rows(
            gcum, beta, rq, rk, decay, h_chunks, r, o_j, p_half, S0, S1, n_G, n_Gl, n_beta, n_rk, n_rq, bos, eos,
            c, i, n_chunks, first_chunk, i_h, i_hv, H, HV, K, V, SK, L2NORM, BETA, GK, STORE_STATES)

        mbarrier.wait(loaded.index(stage), ((i // STAGES) & 1).to(gl.int32))
        S0, S1, out = _chunk_step(k_s, q_s, kd_s, stage * NK, v_s.index(stage * 2 + CH), p_s.index(stage),
                                  a_s.index(stage), s_s, CH * NK, y_t, vn_t, vd_t, S0, S1, zero,
                                  b_G, b_Gl, b_beta, b_rk, b_rq, b_dec0, b_dec1, m_t, scale, tile_v * BVC < V,
                                  acc, NK, GK, SEG != 1, DELTA)
        mbarrier.arrive(freed.index(stage), count=1)                        # this chain is done with the stage
        if SEG != 1:
            _store_output(out, o_desc, o_s.index(CH), o, t0, eos, r, o_v, i_hv, tile_v, n_rows, HV, V, BVC)

    tma.store_wait(0)
    if SEG == 1:                # the summary [E | Phi] ``[segments, HV, K, V + K]``
        _store_half_pair(seg_state + (i_s * HV + i_hv) * K * (V + K) + o_j[:, None] * (V + K) + o_v[None, :],
                         S0, S1, K, V + K)
    elif STORE_FINAL:
        _store_final(ht, S0, S1, i_n, i_hv, p_half, o_j, is_last, HV, K, V, SK)


@gluon.jit(do_not_specialize=["T", "NT", "n_rows"])     # T = 1 would compile a variant of its own
def _scan_dual_sm90_kernel(
    k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, o_desc,
    beta, rq, rk, gcum, decay, o, h0, ht, h_chunks, cu_seqlens, chunk_start, segments, seg_state,
    T, NT, n_rows, scale,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
    SK: gl.constexpr, SV: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
    L2NORM: gl.constexpr, VARLEN: gl.constexpr, SEG: gl.constexpr, BETA: gl.constexpr,
    STORE_STATES: gl.constexpr, STAGES: gl.constexpr, GK: gl.constexpr, CHAIN_NREG: gl.constexpr,
    LOADER_NREG: gl.constexpr, DELTA: gl.constexpr,
):
    NK: gl.constexpr = K // BK
    BVC: gl.constexpr = BV // 2
    i_v, i_hv, i_h, i_s, i_n, bos, eos, first_chunk, c_begin, n_chunks, is_last = _program(
        segments, cu_seqlens, chunk_start, T, NT, H, HV, K, V, BV, VARLEN, SEG)

    tile: gl.constexpr = k_desc.layout
    vtile: gl.constexpr = v_desc.layout                                    # [BT, BVC] boxes
    k_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NK, BT, BK], tile)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NK, BT, BK], tile)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], tile)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], tile)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 2, BT, BVC], vtile)
    if GK:
        kd_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NK, BT, BK], tile)
    else:
        kd_s = k_s
    # per chain
    s_s = gl.allocate_shared_memory(gl.bfloat16, [2 * NK, BK, BVC], vtile)
    y_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BVC], vtile)
    vn_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BVC], vtile)
    if GK:
        vd_s = vn_s
    else:
        vd_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BVC], vtile)
    o_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BVC], o_desc.layout)
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    freed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    for st in gl.static_range(STAGES):
        mbarrier.init(loaded.index(st), count=1)
        mbarrier.init(freed.index(st), count=2)
    fence_async_shared()

    i_hv32 = i_hv.to(gl.int32)
    i_h32 = i_hv32 if GK else i_h.to(gl.int32)                           # the column block of k, q (and kd)
    gl.warp_specialize([
        (_chain_partition, (0, k_s, q_s, kd_s, v_s, p_s, a_s, s_s, y_s, vn_s, vd_s, o_s, loaded, freed, o_desc,
                            beta, rq, rk, gcum, decay, o, h0, ht, h_chunks, seg_state, bos, eos, c_begin, n_chunks,
                            first_chunk, is_last, i_n, i_s, i_h, i_hv32, i_v, n_rows, scale, H, HV, K, V, BV, SK, SV,
                            HAS_H0, STORE_FINAL, L2NORM, BETA, SEG, STORE_STATES, STAGES, GK, DELTA)),
        (_chain_partition, (1, k_s, q_s, kd_s, v_s, p_s, a_s, s_s, y_s, vn_s, vd_s, o_s, loaded, freed, o_desc,
                            beta, rq, rk, gcum, decay, o, h0, ht, h_chunks, seg_state, bos, eos, c_begin, n_chunks,
                            first_chunk, is_last, i_n, i_s, i_h, i_hv32, i_v, n_rows, scale, H, HV, K, V, BV, SK, SV,
                            HAS_H0, STORE_FINAL, L2NORM, BETA, SEG, STORE_STATES, STAGES, GK, DELTA)),
        (_loader_partition, (k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s,
                             loaded, freed, bos, c_begin, n_chunks, i_h32, i_hv32, i_v, K, V, BV, STAGES, GK, SEG,
                             DELTA)),
    ], [4, 1], [CHAIN_NREG, LOADER_NREG])
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(loaded.index(st))
        mbarrier.invalidate(freed.index(st))
