"""Hopper (sm_90) decode of one token per sequence: persistent programs stream the state through TMA.

Serves the single-token calls of the five ``fused_recurrent_*`` ops (the step's math is the Triton
kernel's own: ``recurrent.token_decay`` and ``recurrent.token_update``) where the state traffic
bounds the step. The Triton kernel (backends/triton/recurrent.py) holds a program's ``[K, BV]``
tile in registers from its load to its store, so the bytes in flight per SM are capped by the
register file: a bf16 state at 255 registers ran 8 programs an SM and 2.8 TB/s at N = 256
(docs/notes/decode.md, v5). Here the tiles land in shared memory by TMA, STAGES - 1 tiles ahead
of the one being computed, and leave by TMA stores that nobody waits for until their buffer is
needed again: the registers hold one tile at a time while the rest are in flight.

Inputs: q, k rows ``[N, H, K]``, v ``[N, HV, V]`` (one token per sequence, element strides along
the sequence and the head; the last dim contiguous), the gates and beta as the Triton kernel takes
them; the state through two TMA descriptors of one 2-D view each, ``[heads x K, V]`` (box
``[K, BV]``) or with ``V_FIRST`` ``[heads x V, K]`` (box ``[BV, K]``), fp32 or bf16; heads =
pool slots x HV (``POOL``: the sequence's slot from ``slots``, negative: skipped, its output zero
and its slot untouched) or N x HV (the initial state in, the final state out, FLA's form).
Output o ``[N, HV, V]`` by plain stores.

Grid ``(programs,)``, 4 warps, no specialization: program p takes tiles p, p + programs, ...;
tile t = (sequence, value head, V tile), a head's V tiles adjacent. Per tile, with its token's
inputs and the next refill's slot loaded one tile ahead into registers:
    wait the stage's mbarrier; state smem -> registers (fp32)                       [K, BV]
    refill the stage with the tile STAGES ahead (every thread has read it)
    the token's step (decay, the delta rule, the output); the output by plain stores
    new state -> one of two store buffers (its last TMA store waited) -> TMA store
Register layouts put the warps along V, so the reductions over K stay inside a warp; the
prefetched [K] inputs are held one element a thread and moved to the tile's row layout when used
(in that layout a thread would hold 16 of each at 64 columns).
Every call streams a start state and writes the new one (``supports`` hands calls without an
initial state, with ``disable_state_update`` or without a final state to the Triton kernel).
Budget (K = V = 128, sm_90 compile, tests/backends/test_gluon_sm90.py): 64 columns, bf16, 2
stages: 128 registers (GDN) / 156 (KDA's per-key gate), 65 KB of shared memory, three
programs an SM (the shipped plan, backends/gluon/recurrent.py); fp32 at 3 stages 160 KB.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from fastla.backends.triton.recurrent import token_decay, token_update


@gluon.constexpr_function
def _state_layout(BK, BV, V_FIRST, num_warps):
    """Registers of a [BK, BV] tile: warps along V, so that the reductions over K stay inside a
    warp (shuffles, no barrier); each thread's four elements contiguous in shared memory. K-major,
    a warp's lanes split its BV / num_warps columns four at a time and the rest go along K;
    V-first, lanes along K (the transpose of ``_stored_layout``)."""
    if V_FIRST:
        tk = min(32, BK // 4)
        return gl.BlockedLayout([4, 1], [tk, 32 // tk], [1, num_warps], [0, 1])
    tv = min(8, max(1, BV // num_warps // 4))
    return gl.BlockedLayout([1, 4], [32 // tv, tv], [1, num_warps], [1, 0])


@gluon.constexpr_function
def _stored_layout(BK, BV, num_warps):
    """Registers of a V-first [BV, BK] tile as it lies in shared memory (K contiguous)."""
    tk = min(32, BK // 4)
    return gl.BlockedLayout([1, 4], [32 // tk, tk], [num_warps, 1], [1, 0])


@gluon.jit
def _tile(t, n_tiles, slots, stride_slots, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
          V_FIRST: gl.constexpr, POOL: gl.constexpr):
    """Tile t's sequence, value head, V tile, its first row and column in the 2-D state view, and
    whether its slot is live (int32: the views stay under 2^31 rows, checked on the host). Tiles
    past the last (a program's prefetch) read no slot."""
    NV: gl.constexpr = V // BV
    i_v = t % NV
    i_n = t // NV // HV
    i_hv = t // NV % HV
    if POOL:
        slot = gl.load(slots + i_n.to(gl.int64) * stride_slots, mask=t < n_tiles, other=0).to(gl.int32)
    else:
        slot = i_n
    head = gl.maximum(slot, 0) * HV + i_hv
    if V_FIRST:
        row = head * V + i_v * BV
        col = i_v * 0
    else:
        row = head * K
        col = i_v * BV
    return i_n, i_hv, i_v, row, col, slot >= 0


@gluon.jit
def _issue_load(desc, buf, bar, row, col, live, exists, nbytes: gl.constexpr):
    """The tile's state into ``buf``, completing ``bar``; a skipped slot completes it with no bytes."""
    mbarrier.expect(bar, nbytes, pred=exists & live)
    tma.async_copy_global_to_shared(desc, [row, col], bar, buf, pred=exists & live)
    mbarrier.arrive(bar, pred=exists & (live == 0))


@gluon.jit
def _token_inputs(q, k, v, g, gk, beta, A_log, dt_bias, g_gamma, i_n, i_hv, i_v, exists, o_k, o_c,
                  sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sg_h, sgk_n, sgk_h, sb_n, sb_h,
                  H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, BV: gl.constexpr,
                  DELTA: gl.constexpr, HAS_G: gl.constexpr, HAS_GK: gl.constexpr, HAS_GAMMA: gl.constexpr,
                  GATE: gl.constexpr, HAS_A: gl.constexpr, HAS_BIAS: gl.constexpr, BETA: gl.constexpr):
    """A tile's token inputs in fp32: q, k, the raw per-key gate, the dt bias per key [BK]; v [BV];
    the raw scalar gate, exp(A_log), the scalar dt bias, g_gamma and the raw beta. Loaded a tile
    ahead of their use (nothing here waits on them)."""
    i_n64 = i_n.to(gl.int64)
    i_hv64 = i_hv.to(gl.int64)              # (a head-major view's head stride is N x K: int64 products)
    i_h = i_hv64 // (HV // H)
    m_k = (o_k >= 0) & exists
    b_q = gl.load(q + i_n64 * sq_n + i_h * sq_h + o_k, mask=m_k, other=0.0).to(gl.float32)
    b_k = gl.load(k + i_n64 * sk_n + i_h * sk_h + o_k, mask=m_k, other=0.0).to(gl.float32)
    b_v = gl.load(v + i_n64 * sv_n + i_hv64 * sv_h + i_v * BV + o_c, mask=(o_c >= 0) & exists,
                  other=0.0).to(gl.float32)
    b_beta = 1.0
    if DELTA and BETA != 0:
        b_beta = gl.load(beta + i_n64 * sb_n + i_hv64 * sb_h, mask=exists, other=0.0).to(gl.float32)
    b_g = 0.0
    if HAS_G:
        b_g = gl.load(g + i_n64 * sg_n + i_hv64 * sg_h, mask=exists, other=0.0).to(gl.float32)
    b_gk = b_q
    if HAS_GK:
        b_gk = gl.load(gk + i_n64 * sgk_n + i_hv64 * sgk_h + o_k, mask=m_k, other=0.0).to(gl.float32)
    b_A = 1.0
    if HAS_A:
        b_A = gl.exp(gl.load(A_log + i_hv, mask=exists, other=0.0).to(gl.float32))
    b_bias = 0.0
    b_bias_k = b_q
    if HAS_BIAS:
        if GATE == 1:
            b_bias = gl.load(dt_bias + i_hv, mask=exists, other=0.0).to(gl.float32)
        else:
            b_bias_k = gl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(gl.float32)
    b_gamma = 0.0
    if HAS_GAMMA:
        b_gamma = gl.load(g_gamma + i_hv, mask=exists, other=0.0).to(gl.float32)
    return b_q, b_k, b_v, b_g, b_gk, b_A, b_bias, b_bias_k, b_gamma, b_beta


@gluon.jit
def _decode_sm90_kernel(
    h_in, h_out,                                          # TMA descriptors of the state's 2-D views
    q, k, v, g, gk, beta, A_log, dt_bias, g_gamma, o, slots,
    scale, lower_bound, n_tiles, n_rows, stride_slots,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,                   # element strides (sequence, head)
    sg_n, sg_h, sgk_n, sgk_h, sb_n, sb_h,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
    V_FIRST: gl.constexpr, DELTA: gl.constexpr, HAS_G: gl.constexpr, HAS_GK: gl.constexpr,
    HAS_GAMMA: gl.constexpr, GATE: gl.constexpr, HAS_A: gl.constexpr, HAS_BIAS: gl.constexpr,
    L2NORM: gl.constexpr, BETA: gl.constexpr, POOL: gl.constexpr, STAGES: gl.constexpr,
):
    L: gl.constexpr = _state_layout(K, BV, V_FIRST, gl.num_warps())
    LT: gl.constexpr = _stored_layout(K, BV, gl.num_warps())
    RL: gl.constexpr = gl.SliceLayout(1, L)
    # the prefetched [K] inputs' key rows, one element a thread (in RL a thread holds one copy per
    # column lane group), moved to the tile's row layout RL when used
    KL: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    o_kl = gl.arange(0, K, layout=KL)
    o_c = gl.arange(0, BV, layout=gl.SliceLayout(0, L))                   # value columns of a tile
    nbytes: gl.constexpr = K * BV * h_in.dtype.primitive_bitwidth // 8
    shape: gl.constexpr = [BV, K] if V_FIRST else [K, BV]
    bufs = gl.allocate_shared_memory(h_in.dtype, [STAGES] + shape, h_in.layout)      # loads in flight
    outs = gl.allocate_shared_memory(h_out.dtype, [2] + shape, h_out.layout)         # stores in flight
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()

    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_mine = (n_tiles - pid + programs - 1) // programs                   # tiles pid, pid + programs, ..
    for st in gl.static_range(STAGES):
        _, _, _, row, col, live = _tile(pid + st * programs, n_tiles, slots, stride_slots, HV, K, V, BV, V_FIRST, POOL)
        _issue_load(h_in, bufs.index(st), bars.index(st), row, col, live, st < n_mine, nbytes)
    # the tile a stage is refilled with (STAGES ahead), its slot read an iteration before its use
    _, _, _, f_row, f_col, f_live = _tile(pid + STAGES * programs, n_tiles, slots, stride_slots, HV, K, V, BV,
                                          V_FIRST, POOL)

    i_n, i_hv, i_v, row, col, live = _tile(pid, n_tiles, slots, stride_slots, HV, K, V, BV, V_FIRST, POOL)
    n_in = _token_inputs(q, k, v, g, gk, beta, A_log, dt_bias, g_gamma, i_n, i_hv, i_v, n_mine > 0, o_kl, o_c,
                         sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sg_h, sgk_n, sgk_h, sb_n, sb_h,
                         H, HV, K, BV, DELTA, HAS_G, HAS_GK, HAS_GAMMA, GATE, HAS_A, HAS_BIAS, BETA)
    for j in range(0, n_mine):
        stage = j % STAGES
        b_q, b_k, b_v, b_g, b_gk, b_A, b_bias, b_bias_k, b_gamma, b_beta = n_in
        b_q = gl.convert_layout(b_q, RL)
        b_k = gl.convert_layout(b_k, RL)
        b_gk = gl.convert_layout(b_gk, RL)
        b_bias_k = gl.convert_layout(b_bias_k, RL)
        c_n, c_hv, c_v, c_row, c_col, c_live = i_n, i_hv, i_v, row, col, live
        # the next tile's coordinates and token inputs, loaded while this one computes
        i_n, i_hv, i_v, row, col, live = _tile(pid + (j + 1) * programs, n_tiles, slots, stride_slots, HV, K, V, BV,
                                               V_FIRST, POOL)
        n_in = _token_inputs(q, k, v, g, gk, beta, A_log, dt_bias, g_gamma, i_n, i_hv, i_v, j + 1 < n_mine, o_kl,
                             o_c, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sg_h, sgk_n, sgk_h, sb_n, sb_h,
                             H, HV, K, BV, DELTA, HAS_G, HAS_GK, HAS_GAMMA, GATE, HAS_A, HAS_BIAS, BETA)

        b_a = token_decay(gl.full([K], 1.0, gl.float32, RL), b_g, b_gk, b_A, b_bias, b_bias_k,
                          b_gamma, lower_bound, HAS_G, HAS_GK, HAS_GAMMA, GATE, HAS_BIAS)
        buf = bufs.index(stage)
        mbarrier.wait(bars.index(stage), (j // STAGES) & 1)
        if V_FIRST:                                                       # [BV, K] in shared memory
            b_h = gl.convert_layout(gl.permute(buf.load(LT), (1, 0)), L, assert_trivial=True)
        else:
            b_h = buf.load(L)
        b_h = gl.where(c_live, b_h.to(gl.float32), 0.0)                  # [K, BV]
        # the tile is in registers: its stage takes the tile STAGES ahead (every thread has read it)
        gl.thread_barrier()
        fence_async_shared()
        more = j + STAGES < n_mine
        _issue_load(h_in, buf, bars.index(stage), f_row, f_col, f_live, more, nbytes)
        t_f = pid + gl.where(more, j + 1 + STAGES, STAGES) * programs
        _, _, _, f_row, f_col, f_live = _tile(t_f, n_tiles, slots, stride_slots, HV, K, V, BV, V_FIRST, POOL)
        b_o, b_h = token_update(b_h, b_a, b_q, b_k, b_v, b_beta, scale, DELTA, BETA, L2NORM)
        if POOL:
            b_o = gl.where(c_live, b_o, 0.0)
        gl.store(o + (c_n.to(gl.int64) * HV + c_hv) * V + c_v * BV + o_c, b_o.to(o.dtype.element_ty))
        out = outs.index(j % 2)
        tma.store_wait(1)                           # the store that used this buffer has left it
        gl.thread_barrier()                         # (waited by the thread that issued it)
        if V_FIRST:
            out.store(gl.convert_layout(gl.permute(b_h.to(h_out.dtype), (1, 0)), LT, assert_trivial=True))
        else:
            out.store(b_h.to(h_out.dtype))
        fence_async_shared()
        # a skipped slot's tile is sent past the view's last row: TMA writes nothing out of bounds
        # (no branch around the store: ptxas crashed on one in chunk_delta_sm90)
        tma.async_copy_shared_to_global(h_out, [gl.where(c_live, c_row, n_rows), c_col], out)
    tma.store_wait(0)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))
