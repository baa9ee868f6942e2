"""Hopper (sm_90) prologue of the KDA chunked forward, every gate (the bounded one computed in the
op, the softplus one without lower_bound, a given log decay in bf16 or fp32): Gluon, async wgmma,
one launch for what the Triton prologue (backends/triton/chunk_prepare_kda.py) does in two (then
the inverse kernel, and for unbounded gates the wide-block rewrite before it).

Per 64-token chunk and value head, with G the in-chunk cumsum of the log decay (log2 units), unit
keys and queries when the l2norm is in the op, and per-channel products
``(a * b)_ij = sum_c a_ic b_jc 2^(G_ic - G_jc)``, it writes
    A   = strict_lower(diag(beta) (k * k))     fp32 / fp16  [B * T, HV, 64]  (scratch: the inverse
                                                          kernel turns it into P = (I + A)^-1;
                                                          fp16 where |A| <= 2: A_FP16)
    Aqk = scale lower(q * k)                         bf16  [B * T, HV, 64]  (whole rows, zeros above)
    kg = k 2^G,  qg = scale q 2^G,  kd = k 2^(G_last - G)     bf16  [B * T, HV, K]
    decay = 2^(G_last)                               fp32  [chunks, HV, K]

Persistent grid ``(min(chunks x HV, PROGRAMS_PER_SM x SMs),)``, 4 warps (one warpgroup): a program
takes the items (chunk, value head; chunks fastest) p, p + programs, ... in turn, K in slices of
32 channels. q and k come by TMA into shared memory ([64, 32] boxes, every slice: rows past B * T
are zero-filled, rows of the next sequence are masked), the next item's into a second buffer while
this one's products run (QK_BUFFERS 2; with an fp32 gate one buffer, reloaded after the slices, so
that two programs fit an SM); the gate's input comes a slice at a time through two slots, each
refilled with the slice two ahead (this item's or the next's) as soon as it is read. With the l2norm
in the op, the rows' norms come from the diagonals of K K^T and Q Q^T by wgmma on those tiles. Elementwise work is in [4, 16, 32]
tiles (block b, row in the block, channel): warp = block, lane = channel, a block's 16 rows in one
thread, so the cumsum within a block is 15 adds in registers; the four block sums go through
shared memory once and each thread scans them for its channel. Column block c of A and Aqk is
referenced at M_c, the midpoint of G over block c (per channel):
    A[:, block c]   += (k 2^(G - M_c)) R_c^T,   R_c = k 2^(M_c - G) on block c's rows
    Aqk[:, block c] += (scale q 2^(G - M_c)) R_c^T
(wgmma, M 64, N 16, K 32, one per column block and side). On block c's own rows both operands lie
within 2^(+-span / 2); on a later block b's rows the left one is X 2^(c_(b-1) - M_c) with X = k
2^(G - c_(b-1)), two factors <= 1 (not k 2^(G - M_b) 2^(M_b - M_c): that factor can underflow fp32
against a large first one), and rows of earlier blocks are zero. So every operand stays in bf16's
range while a block's span is at most SPAN_LIMIT (200 log2 units: 2^(+-100)), whatever the decay
elsewhere; a left operand only underflows where its product is below 2^-26 |k_i k_j|. Products that
overflow lie above the diagonal and are masked. The bounded gate (span <= 16 x 5 nats = 115) always
fits. Unbounded and given gates set bit b of flags[chunk, head] for a wider block b (all four bits
for a rising gate), and a Triton kernel (backends/triton/chunk_prepare_kda_wide.py) rewrites those
blocks' rows and columns of A and Aqk and their gated keys and queries exactly, before the inverse
kernel: ~1% of blocks at the registry's softplus gate. The left operands (four copies per side)
live in shared memory channel-major ([32, 64] bf16: a thread's 16 rows are one 32-byte run), R_c^T
as [32, 16], the accumulators in registers (8 x [64, 16] fp32); kg = X 2^(c_(b-1)), qg likewise and
kd = R_b 2^(G_last - M_b) are stored per slice while the products run. Shared memory at K = 128: 64 KB of
q / k tiles (two items) and 8 KB of gate slots with a bf16 gate (32 + 16 KB with an fp32 one), 36 KB
of operands and 0.25 KB for the blocks' sums: 108.75 KB, two programs per SM (255 registers; no stack
in the registry's dense build, up to 168 bytes in the others: tests/backends/test_gluon_sm90.py).
Two build options, on by default (module flags below, v19-v20 in the notes): the bounded gate's
operands from X (FROM_X), whole chunks without row masks (FULL); the slice loop takes 4 barriers
(14 before v21: the operand tiles' views of one allocation, the sums' converts across warps).
The fp32 A scratch is B T HV 256 bytes (0.5 GB at 1x32k, HV 64; half in fp16). P formed
here instead (the diagonal blocks by substitution, then block-Jacobi steps on wgmma) measured no
faster than the inverse kernel: +114 us in this kernel against the inverse's 119 at 1x8k H64
(notes, v6).

Budget and measurements: docs/notes/kda-prefill.md (v4 to v21; persistent since v10: 1x8k H64
523 -> 491 us with the inverse; v19-v21 on the H200: the call 736.9 -> 681.0 us).
"""
from __future__ import annotations

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from fastla.backends.triton.chunk_index import _chunk
from fastla.backends.triton.chunk_prepare import _activate_beta
from fastla.core import call_plan

LOG2E = gl.constexpr(1.4426950408889634)
BC = gl.constexpr(32)      # channels per slice
# widest block span (log2 units) of the midpoint-referenced products: operands within 2^(+-100) |k|
# (bf16 tops out at 2^128); the bounded gate's widest is 16 x 5 nats = 115
SPAN_LIMIT = gl.constexpr(200.0)
RISING = gl.constexpr(1e30)    # a block's "span" where the gate rises (FLAG: every block of the chunk)
# a log2 decay above this rises (lg2.approx's absolute error near 1 can make the softplus gate's
# -a log2(1 + 2^x) a hair positive; a rise this small changes no factor)
RISE_TOLERANCE = gl.constexpr(1e-5)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _operand_tiles(layout: gl.constexpr):
    """Four [32, 64] bf16 tiles (one per column block) as a tuple of four allocations: Triton's
    barrier analysis does not tell one buffer's views apart, and views of one allocation put a
    barrier between the stores of consecutive column blocks (three a slice)."""
    return (gl.allocate_shared_memory(gl.bfloat16, [BC, 64], layout),
            gl.allocate_shared_memory(gl.bfloat16, [BC, 64], layout),
            gl.allocate_shared_memory(gl.bfloat16, [BC, 64], layout),
            gl.allocate_shared_memory(gl.bfloat16, [BC, 64], layout))


@gluon.jit
def _pick(x, ic, c: gl.constexpr, layout: gl.constexpr):
    """Column block c of ``x`` [1, 4, 32] (the blocks in each thread's registers: no instruction)
    as [1, 32] in ``layout``."""
    return gl.convert_layout(gl.sum(gl.where(ic == c, x, 0.0), 1), layout)


@gluon.jit
def _log2_approx(x):
    """log2 on MUFU.LG2 (lg2.approx, ~2^-22 relative error); gl.log2 compiles to libdevice's
    polynomial, ~70 instructions an element."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _rcp_approx(x):
    """1 / x on MUFU.RCP (rcp.approx.ftz, ~1 ulp; results below 2^-126 flushed to 0): fp32 division
    compiles to div.full, which also scales denominators past 2^126 (a compare and two predicated
    multiplies an element)."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _slice(x_s, ks, valid, L3: gl.constexpr, MASK: gl.constexpr = True):
    """Slice ks [4, 16, 32] of a chunk's tile in shared memory as fp32, 0 past n_left (not MASK: as
    loaded, where every use masks those rows itself)."""
    x = gl.convert_layout(gl.reshape(x_s.index(ks).load(gl.BlockedLayout([16, 1], [1, 32], [4, 1], [0, 1])),
                                     [4, 16, BC]), L3).to(gl.float32)
    if MASK:
        x = gl.where(valid, x, 0.0)
    return x


@gluon.jit
def _row_norms(x_s, base, NS: gl.constexpr, L3: gl.constexpr):
    """1 / |x_t| [4, 16, 1] (FLA's eps) from the diagonal of X X^T, by wgmma over the NS slices
    base .. base + NS - 1 in shared memory (no sums across lanes; rows past the chunk's end are masked where they are used)."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    acc = gl.zeros([64, 64], gl.float32, acc_l)
    for ks in gl.static_range(NS):
        acc = warpgroup_mma(x_s.index(base + ks), x_s.index(base + ks).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, acc_l))
    n = gl.rsqrt(gl.sum(gl.where(r[:, None] == c[None, :], acc, 0.0), 1) + 1e-6)   # [64] rows
    return gl.expand_dims(gl.convert_layout(gl.reshape(n, [4, 16]), gl.SliceLayout(2, L3)), 2)


@gluon.jit
def _column_operands(x_s, q_s, c: gl.constexpr, on_c, kmid, qmid, X, Q, below, DELTA: gl.constexpr,
                     FROM_X: gl.constexpr):
    """Column block c's left operands k 2^(G - M_c), scale q 2^(G - M_c) into shared memory,
    channel-major ([32, 64]: each thread's 16 rows are contiguous there). On block c (``on_c``
    [4, 1, 1]) they are kmid, qmid (referenced at the row's own block's midpoint); below it X, Q
    (k 2^(G - c_(b-1)) <= |k|) times ``below`` = 2^(c_(b-1) - M_c) <= 1 [4, 32] (0 above block
    c): two factors <= 1, so a factor underflows only where the operand is below 2^-126 |k|.
    FROM_X (spans within fp32's normal range, BOUNDED_OPERANDS): block c's rows too are X, Q
    times ``below`` = 2^(c_(c-1) - M_c) = 2^(span / 2) (kmid, qmid unused; no select).
    Not DELTA (GLA): the queries' only."""
    f = gl.expand_dims(below, 1)
    if DELTA:
        left = X * f if FROM_X else gl.where(on_c, kmid, X * f)
        x_s[c].store(gl.permute(gl.reshape(left, [64, BC]), (1, 0)).to(gl.bfloat16))
    left = Q * f if FROM_X else gl.where(on_c, qmid, Q * f)
    q_s[c].store(gl.permute(gl.reshape(left, [64, BC]), (1, 0)).to(gl.bfloat16))


@gluon.jit
def _products(x_s, q_s, f_s, c: gl.constexpr, akk, aqk, DELTA: gl.constexpr):
    """A and Aqk's column block c [64, 16] += (k 2^(G - M_c)) R_c^T and (scale q 2^(G - M_c)) R_c^T
    (not DELTA, GLA: Aqk's only)."""
    rT = f_s.slice(c * BC, BC, dim=0)                                       # R_c^T [32 channels, 16 columns]
    if DELTA:
        akk = warpgroup_mma(x_s[c].permute((1, 0)), rT, akk, is_async=True)
    aqk = warpgroup_mma(q_s[c].permute((1, 0)), rT, aqk, is_async=True)
    return akk, aqk


@gluon.jit
def _store_rows(ptr, value, valid, FULL: gl.constexpr):
    """``value`` to ``ptr`` on the chunk's rows: those < n_left (``valid``), or all of them where
    every chunk has 64 rows (FULL: no predicates to keep or recompute)."""
    if FULL:
        gl.store(ptr, value)
    else:
        gl.store(ptr, value, mask=valid)


@gluon.jit
def _store_columns(a_kk, a_qk, row_off, r, valid_r, beta_r, c: gl.constexpr, akk, aqk, cols_l: gl.constexpr,
                   DELTA: gl.constexpr, FULL: gl.constexpr):
    """Columns 16c .. 16c + 15 of A (strict lower, times beta; fp32; not for GLA, not DELTA) and Aqk
    (lower, bf16), rows < n_left."""
    col = (16 * c + gl.arange(0, 16, layout=cols_l))[None, :]
    off = row_off[:, None] + col
    m = valid_r[:, None]
    if DELTA:
        _store_rows(a_kk + off, gl.where(col < r[:, None], akk * beta_r[:, None], 0.0).to(a_kk.dtype.element_ty),
                    m, FULL)
    _store_rows(a_qk + off, gl.where(col <= r[:, None], aqk, 0.0).to(gl.bfloat16), m, FULL)


@gluon.jit
def _item(j, total, chunk_index, cu_seqlens, T, NT, H: gl.constexpr, HV: gl.constexpr, VARLEN: gl.constexpr):
    """Work item j (chunks fastest, then value heads): (i_c int64, i_hv, i_h, its first row t0,
    its sequence's end eos)."""
    i_c = (j % total).to(gl.int64)
    i_hv = j // total
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    return i_c, i_hv, i_hv // (HV // H), bos + c * 64, eos


@gluon.jit
def _load_qk(q_desc, k_desc, q_in, k_in, bar, buf, t0, i_h, pred, K: gl.constexpr, NS: gl.constexpr):
    """An item's q and k tiles ([64, 32] per slice) into buffer ``buf`` by TMA (rows past B * T
    zero-filled; rows of the next sequence are masked where they are used)."""
    mbarrier.expect(bar, NS * 64 * BC * 2 * q_desc.dtype.primitive_bitwidth // 8, pred=pred)
    for ks in gl.static_range(NS):
        tma.async_copy_global_to_shared(q_desc, [t0.to(gl.int32), i_h * K + ks * BC], bar, q_in.index(buf * NS + ks),
                                        pred=pred)
        tma.async_copy_global_to_shared(k_desc, [t0.to(gl.int32), i_h * K + ks * BC], bar, k_in.index(buf * NS + ks),
                                        pred=pred)


@gluon.jit
def _load_gate(g_desc, g_in, bar, slot, t0, i_hv, ks, pred, K: gl.constexpr):
    """Slice ks of an item's gate input ([64, 32]) into slot ``slot`` by TMA."""
    mbarrier.expect(bar, 64 * BC * g_desc.dtype.primitive_bitwidth // 8, pred=pred)
    tma.async_copy_global_to_shared(g_desc, [t0.to(gl.int32), i_hv * K + ks * BC], bar, g_in.index(slot), pred=pred)


@gluon.jit(do_not_specialize=["T", "NT", "total"])
def _kda_prologue_sm90_kernel(
    q_desc, k_desc, g_desc, beta, A_log, dt_bias, lower_bound, scale, a_kk, a_qk, kg, kd, qg, decay, flags,
    rq_out, rk_out, cu_seqlens, chunk_index, T, NT, total,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, L2NORM: gl.constexpr, GATE: gl.constexpr,
    HAS_A: gl.constexpr, HAS_BIAS: gl.constexpr, BETA: gl.constexpr, VARLEN: gl.constexpr, FLAG: gl.constexpr,
    QK_BUFFERS: gl.constexpr, DELTA: gl.constexpr, FROM_X: gl.constexpr, FULL: gl.constexpr, GATED: gl.constexpr,
    AHEAD: gl.constexpr,
):
    """Persistent: program p takes items p, p + programs, ... (``total`` chunks x HV value heads,
    chunks fastest). GATE as recurrent.py numbers it: 3 the bounded gate in the op; 2
    (-softplus) and 0 (the log decay given) are unbounded and need FLAG: flags[chunk, head] gets
    bit b for a block b whose span passes SPAN_LIMIT, all four bits for a rising (positive) gate
    anywhere in the chunk (what depends on those blocks may be wrong: the wide-block kernel
    rewrites it). QK_BUFFERS 2: the next item's q and k load while this one's products run; 1:
    after them (an fp32 gate, for two programs an SM). DELTA False (GLA, the plain rule): no A
    nor kg (their operands, products and stores), Aqk, qg, kd and decay as for KDA. FROM_X (the
    bounded gate, BOUNDED_OPERANDS): X = k 2^(G - c_(b-1)) from k directly and every left operand
    from X (see _column_operands), q and k slices unmasked (rows past n_left reach only rows and
    columns that the stores mask; their gate is zeroed by the activation), the sigmoid's division
    by _rcp_approx (its denominator 1 + 2^z >= 1). FULL (a dense batch of whole chunks,
    FULL_CHUNKS): the gate's activation and the stores of kd, kg, qg, A and Aqk without row masks.
    The masked stores take a predicate a row, and with seven predicate registers the compiler
    recomputes them at every store. GATED False (the scan forms kg, qg and kd from q, k and the
    gate: gluon/chunk_delta.gates_in_scan): none of the three is computed nor stored, and with
    L2NORM the rows' 1 / |q| and 1 / |k| go to ``rq_out``, ``rk_out`` ``[B * T, H]`` instead (by
    the items of each q/k head's first value head; the scan weights its products by them). AHEAD
    (LOADS_AHEAD, with FROM_X): the gate's bias a slice ahead and beta at the item's start, both
    under earlier work, instead of each where it is used (after the slot's barrier; after the
    slices)."""
    gl.static_assert(K % BC == 0, "K in slices of 32 channels")
    NS: gl.constexpr = K // BC
    gl.static_assert(NS % 2 == 0, "the gate's slices alternate between two slots")
    L3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16, 1], threads_per_warp=[1, 1, 32],
                                        warps_per_cta=[4, 1, 1], order=[2, 1, 0])
    L_bc: gl.constexpr = gl.SliceLayout(1, L3)                              # [4, 32] (block, channel)
    # [4, 4, 32] (row block b, column block c, channel): every block's sums in each thread
    L4: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4, 1], threads_per_warp=[1, 1, 32],
                                        warps_per_cta=[4, 1, 1], order=[2, 1, 0])
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    x_tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    f_tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    cols_l: gl.constexpr = gl.SliceLayout(0, acc_l)

    ib3 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    ir3 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    o_c = gl.arange(0, BC, layout=gl.SliceLayout(0, L_bc))[None, None, :]  # [1, 1, 32]
    t = ib3 * 16 + ir3                                                      # [4, 16, 1] chunk rows
    ib = gl.arange(0, 4, layout=gl.SliceLayout(1, L_bc))[:, None]           # [4, 1] block of a [4, 32]
    o_c2 = gl.arange(0, BC, layout=gl.SliceLayout(0, L_bc))[None, :]       # [1, 32]
    ib4 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L4)))[:, None, None]    # [4, 1, 1] in L4
    ic4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L4)))[None, :, None]    # [1, 4, 1]
    r = gl.arange(0, 64, layout=rows_l)
    items = total * HV
    programs = gl.num_programs(0)

    # q and k of QK_BUFFERS items, the gate's slices through two slots (slice u of the program's
    # sequence of slices in slot u % 2), each buffer and slot with its mbarrier
    q_in = gl.allocate_shared_memory(q_desc.dtype, [QK_BUFFERS * NS, 64, BC], q_desc.layout)
    k_in = gl.allocate_shared_memory(k_desc.dtype, [QK_BUFFERS * NS, 64, BC], k_desc.layout)
    g_in = gl.allocate_shared_memory(g_desc.dtype, [2, 64, BC], g_desc.layout)
    qk_bar = gl.allocate_shared_memory(gl.int64, [QK_BUFFERS, 1], mbarrier.MBarrierLayout())
    g_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(QK_BUFFERS):
        mbarrier.init(qk_bar.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(g_bar.index(i), count=1)
    x_s = _operand_tiles(x_tile)                                           # left operands (k) per column block
    q_s = _operand_tiles(x_tile)                                           # left operands (q)
    f_s = gl.allocate_shared_memory(gl.bfloat16, [4 * BC, 16], f_tile)    # R_c^T in rows 32c .. 32c + 31
    sums_s = gl.allocate_shared_memory(gl.float32, [4, BC], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))   # block sums
    fence_async_shared()

    j0 = gl.program_id(0)
    _, hv0, h0, t00, _ = _item(j0, total, chunk_index, cu_seqlens, T, NT, H, HV, VARLEN)
    _load_qk(q_desc, k_desc, q_in, k_in, qk_bar.index(0), 0, t00, h0, j0 < items, K, NS)
    _load_gate(g_desc, g_in, g_bar.index(0), 0, t00, hv0, 0, j0 < items, K)
    _load_gate(g_desc, g_in, g_bar.index(1), 1, t00, hv0, 1, j0 < items, K)
    # the gate's bias a slice ahead (loaded under the previous slice, not after the slot's barrier)
    bias_n = gl.zeros([1, 1, BC], gl.float32, L3)
    if AHEAD and HAS_BIAS and GATE != 0:
        bias_n = gl.load(dt_bias + hv0 * K + o_c, mask=(o_c < BC) & (j0 < items), other=0.0).to(gl.float32)
    it = 0
    for j in range(j0, items, programs):
        i_c, i_hv, i_h, t0, eos = _item(j, total, chunk_index, cu_seqlens, T, NT, H, HV, VARLEN)
        has_next = j + programs < items
        _, hv_n, h_n, t0_n, _ = _item(gl.minimum(j + programs, items - 1), total, chunk_index, cu_seqlens, T, NT,
                                      H, HV, VARLEN)
        n_left = eos - t0                                                   # tokens of the chunk from t0, >= 1
        if FROM_X:
            n_left = gl.minimum(n_left, 64).to(gl.int32)                    # (32-bit row masks)
        valid = t < n_left
        beta_base = t0 * HV + i_hv                                          # chunk row 0 in beta, A, Aqk
        gate_base = beta_base * K                                           # chunk row 0 in g, kg, kd, qg
        valid_r = r < n_left
        if AHEAD and DELTA:                                                 # (loaded under the slices)
            beta_in = gl.load(beta + beta_base + r * HV, mask=valid_r, other=0.0)
        buf = it % QK_BUFFERS
        if QK_BUFFERS == 2:                     # the next item's q and k (the other buffer: read last item)
            gl.thread_barrier()
            _load_qk(q_desc, k_desc, q_in, k_in, qk_bar.index(1 - buf), 1 - buf, t0_n, h_n, has_next, K, NS)
        mbarrier.wait(qk_bar.index(buf), (it // QK_BUFFERS) & 1)

        if L2NORM:
            rk = _row_norms(k_in, buf * NS, NS, L3)
            nq = _row_norms(q_in, buf * NS, NS, L3)
            if not GATED:
                first = valid & (i_hv % (HV // H) == 0)
                gl.store(rk_out + (t0 + t) * H + i_h, rk, mask=first)
                gl.store(rq_out + (t0 + t) * H + i_h, nq, mask=first)
            rq = nq * scale
        else:
            rk = gl.full([4, 16, 1], 1.0, gl.float32, L3)
            rq = gl.full([4, 16, 1], 1.0, gl.float32, L3) * scale
        if HAS_A:
            a_h = gl.exp(gl.load(A_log + i_hv).to(gl.float32))
        else:
            a_h = 1.0

        zero = gl.zeros([64, 16], gl.float32, acc_l)
        k0, k1, k2, k3, q0, q1, q2, q3 = zero, zero, zero, zero, zero, zero, zero, zero
        wide = gl.zeros([4, BC], gl.float32, L_bc)                         # widest span per block and lane,
                                                                            # RISING where the gate rises (FLAG)
        for ks in range(0, NS):
            o_k = o_c + ks * BC
            slot = ks % 2
            bias = bias_n
            if AHEAD and HAS_BIAS and GATE != 0:                            # slice ks + 1, or the next item's 0
                ahead = ks + 1 < NS
                bias_n = gl.load(dt_bias + gl.where(ahead, i_hv, hv_n) * K + o_c + gl.where(ahead, ks + 1, 0) * BC)
                bias_n = bias_n.to(gl.float32)
            mbarrier.wait(g_bar.index(slot), ((it * NS + ks) // 2) & 1)
            # the log decay in log2 units, 0 past n_left
            x = _slice(g_in, slot, valid, L3, not (FROM_X and GATE != 0))
            gl.thread_barrier()                 # the slot refilled: this item's slice ks + 2, else the next's
            same = ks + 2 < NS
            _load_gate(g_desc, g_in, g_bar.index(slot), slot, gl.where(same, t0, t0_n), gl.where(same, i_hv, hv_n),
                       gl.where(same, ks + 2, ks + 2 - NS), same or has_next, K)
            if HAS_BIAS and GATE != 0:
                if not AHEAD:
                    bias = gl.load(dt_bias + i_hv * K + o_k).to(gl.float32)
                x = x + bias
            if GATE == 3:                                                   # lower_bound sigmoid(a (g + dt_bias))
                if FROM_X:
                    x = (LOG2E * lower_bound) * _rcp_approx(1.0 + gl.exp2(-LOG2E * a_h * x))
                else:
                    x = (LOG2E * lower_bound) / (1.0 + gl.exp2(-LOG2E * a_h * x))
                if not FULL:
                    x = gl.where(valid, x, 0.0)
            elif GATE == 2:                                                 # -a softplus(g + dt_bias)
                x = gl.where(valid, -a_h * gl.where(x > 20.0, LOG2E * x, _log2_approx(1.0 + gl.exp2(LOG2E * x))),
                             0.0)
            else:                                                           # given
                x = x * LOG2E
            L = gl.associative_scan(x, 1, _add)                             # [4, 16, 32] G - c_(b-1) within each block
            s = gl.sum(x, 1)                                                # [4, 32] block sums (-span)
            if FLAG:                                                        # in-thread maxima (reduced at the end)
                wide = gl.maximum(wide, gl.where(gl.max(x, 1) > RISE_TOLERANCE, RISING, -s))
            # the blocks' sums through shared memory (one barrier; converts across warps took six),
            # each thread scanning all four for its channel
            sums_s.store(s)
            s_all = gl.expand_dims(sums_s.load(gl.SliceLayout(0, L4)), 0)         # [1, 4, 32] every block's sum
            ends = gl.associative_scan(s_all, 1, _add)                      # c_c
            mids = ends - 0.5 * s_all                                       # M_c
            end = gl.convert_layout(gl.sum(gl.where(ic4 == ib4, ends, 0.0), 1), L_bc)   # [4, 32] c_b
            mid = end - 0.5 * s                                             # M_b, the block's midpoint
            c_last = _pick(ends, ic4, 3, L_bc)                              # [1, 32] G_last
            kb = _slice(k_in, buf * NS + ks, valid, L3, not FROM_X) * rk
            qb = _slice(q_in, buf * NS + ks, valid, L3, not FROM_X) * rq
            if FROM_X:                                                      # (2^L >= 2^-span: normal in fp32)
                e_in = gl.exp2(L)                                           # 2^(G - c_(b-1))
                X = kb * e_in                                               # k 2^(G - c_(b-1)) <= |k|
                Q = qb * e_in
                kmid, qmid = kb, qb                                         # (unused)
            else:
                e_mid = gl.exp2(L - gl.expand_dims(0.5 * s, 1))             # 2^(G - M_b) within 2^(+-span / 2)
                kmid = kb * e_mid
                qmid = qb * e_mid
            R = kb * gl.exp2(gl.expand_dims(0.5 * s, 1) - L)                # k 2^(M_b - G)
            f_s.store(gl.reshape(gl.permute(R, (0, 2, 1)), [4 * BC, 16]).to(gl.bfloat16))
            out = gate_base + t * (HV * K) + o_k
            if GATED:
                if FULL:                        # (not _store_rows: through it the masked builds that ran on the
                    gl.store(kd + out, (R * gl.expand_dims(gl.exp2(c_last - mid), 1)).to(kd.dtype.element_ty))
                else:                           # H200 compile to a different schedule)
                    gl.store(kd + out, (R * gl.expand_dims(gl.exp2(c_last - mid), 1)).to(kd.dtype.element_ty),
                             mask=valid)
            if not FROM_X:
                e_half = gl.expand_dims(gl.exp2(0.5 * s), 1)                # 2^(M_b - c_(b-1)) in [2^-100, 1]
                X = kmid * e_half                                           # k 2^(G - c_(b-1)) <= |k|
                Q = qmid * e_half
            start = end - s                                                 # c_(b-1)
            for cb in gl.static_range(4):
                mid_c = _pick(mids, ic4, cb, L_bc)                          # [1, 32]
                if FROM_X:                                                  # (block cb's own rows: 2^(span / 2))
                    below = gl.where(ib >= cb, gl.exp2(start - mid_c), 0.0)
                else:
                    below = gl.where(ib > cb, gl.exp2(start - mid_c), 0.0)
                _column_operands(x_s, q_s, cb, ib3 == cb, kmid, qmid, X, Q, below, DELTA, FROM_X)
            fence_async_shared()
            k0, q0 = _products(x_s, q_s, f_s, 0, k0, q0, DELTA)
            k1, q1 = _products(x_s, q_s, f_s, 1, k1, q1, DELTA)
            k2, q2 = _products(x_s, q_s, f_s, 2, k2, q2, DELTA)
            k3, q3 = _products(x_s, q_s, f_s, 3, k3, q3, DELTA)
            # the gated keys and queries from the chunk's start (while the products run)
            if GATED:
                e_start = gl.expand_dims(gl.exp2(start), 1)                 # 2^(c_(b-1)) <= 1
                if DELTA:
                    _store_rows(kg + out, (X * e_start).to(kg.dtype.element_ty), valid, FULL)
                _store_rows(qg + out, (Q * e_start).to(qg.dtype.element_ty), valid, FULL)
            gl.store(decay + (i_c * HV + i_hv) * K + ks * BC + o_c2, gl.exp2(c_last))   # (the same from every warp)
            if DELTA:
                k0, k1, k2, k3, q0, q1, q2, q3 = warpgroup_mma_wait(num_outstanding=0,
                                                                    deps=(k0, k1, k2, k3, q0, q1, q2, q3))
            else:
                q0, q1, q2, q3 = warpgroup_mma_wait(num_outstanding=0, deps=(q0, q1, q2, q3))
        if QK_BUFFERS == 1:                     # the next item's q and k, now that this one's are read
            gl.thread_barrier()
            _load_qk(q_desc, k_desc, q_in, k_in, qk_bar.index(0), 0, t0_n, h_n, has_next, K, NS)

        if DELTA:
            if not AHEAD:
                beta_in = gl.load(beta + beta_base + r * HV, mask=valid_r, other=0.0)
            beta_r = _activate_beta(beta_in, valid_r, BETA)
        else:
            beta_r = gl.where(valid_r, 0.0, 0.0)                           # (no A)
        row_off = (beta_base + r * HV) * 64
        _store_columns(a_kk, a_qk, row_off, r, valid_r, beta_r, 0, k0, q0, cols_l, DELTA, FULL)
        _store_columns(a_kk, a_qk, row_off, r, valid_r, beta_r, 1, k1, q1, cols_l, DELTA, FULL)
        _store_columns(a_kk, a_qk, row_off, r, valid_r, beta_r, 2, k2, q2, cols_l, DELTA, FULL)
        _store_columns(a_kk, a_qk, row_off, r, valid_r, beta_r, 3, k3, q3, cols_l, DELTA, FULL)
        if FLAG:                                                            # bit b: block b too wide; all if rising
            bit = 1 << gl.arange(0, 4, layout=gl.SliceLayout(1, L_bc))
            widest = gl.max(wide, 1)                                        # [4]
            bits = gl.sum(gl.where(widest > SPAN_LIMIT, bit, 0), 0)
            gl.store(flags + i_c * HV + i_hv, gl.where(gl.max(widest, 0) >= RISING, 15, bits))
        it += 1
    for i in gl.static_range(QK_BUFFERS):
        mbarrier.invalidate(qk_bar.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(g_bar.index(i))


# Unbounded and precomputed gates on this prologue too (the blocks with a span past SPAN_LIMIT,
# or a rising gate, rewritten by the wide-block kernel); False sends them all to the Triton prologue
UNBOUNDED = True
# Register cap at K = 128 (None: uncapped, 255 registers, no spill; shared memory, 86 KB at K = 128,
# allows two programs per SM either way). The inverse kernel's warps: one measured fastest (two:
# +80 us, four: +180 us at 1x8k H64, benchmarks/results/kda_prefill_sweep-v4-knobs.json).
MAXNREG = None
INVERSE_WARPS = 1
# P = (I + A)^-1 by the Gluon kernel (chunk_inverse_sm90._kda_inverse_sm90_kernel; one warp a
# program, INVERSE_WARPS does not apply): it compiles in ~1 s against the Triton kernel's 5-7 s on
# the 2-core CPU (60 unrolled row loads), the first call's longest compile, which put KDA's first
# call past 10 s on an H100 host (11.8 s bounded gate, 16.0 softplus, 15.0 given; docs/notes/
# kda-prefill.md v28); it ran within the noise of the Triton kernel (v17: 1x8k H64 839.7 vs 830.3
# us). False: the Triton inverse kernel
INVERSE_SM90 = True
# The gate's bias a slice ahead and beta at the item's start (the kernel's AHEAD), on the bounded
# gate's FROM_X builds: an H100 profile of 1x8k H64 (ncu, docs/notes/kda-prefill.md v23) put 6.3%
# of the stall samples on the bias's first use, loaded after the slot's barrier, and 1.7% on beta's,
# loaded after the slices. Bit-equal. Measured (an H100, kda_prefill_sweep-v23-loads-ahead-h100.json,
# CUDA graph, us): 1x8k H64 744.0 -> 732.8, 2x16k H64 2978.7 -> 2972.4. The other builds keep the
# loads where used (with AHEAD their stacks grew 8-16 bytes; not timed). False: where used (A/B)
LOADS_AHEAD = True
# Persistent programs per SM (shared memory at K = 128, sm_90 compile: 108.5 KB with a bf16 gate, q
# and k of two items; 84.5 KB with an fp32 gate, q and k of one); None: one program per item (A/B sweeps)
PROGRAMS_PER_SM = 2
# The bounded gate's left operands all from X = k 2^(G - c_(b-1)) (FROM_X: no kmid / qmid, no
# select on the own block's rows, q and k slices unmasked, 32-bit row masks, the sigmoid's division
# on rcp.approx): the slice loop's sm_90 SASS 1685 -> 1296 instructions a thread, no stack
# (docs/notes/kda-prefill.md v19). With the l2norm in the op only: X = k 2^(G - c_(b-1)) goes
# subnormal where |k_c| 2^(G - c_(b-1)) < 2^-126, and the own block scales it back up by up to
# 2^57.7, so raw keys or queries of magnitude ~2^-26 and below would lose precision that kmid
# keeps (unit rows: only channels below ~2^-26 of the row, whose products do not count). H200
# (v21): 4.6-10.5% off the call (1x8k H64 736.9 -> 692.7 us, 2x16k 2813 -> 2684, varlen H96 2171 ->
# 1944); False: kmid / qmid as before (A/B sweeps)
BOUNDED_OPERANDS = True
# A's scratch in fp16 where its entries are bounded: a gate computed in the op decays (bounded or
# softplus: 2^(G_i - G_j) <= 1 below the diagonal), the l2norm in the op makes |k_i . k_j| <= 1 and
# beta's sigmoid (times 2 with allow_neg_eigval) keeps it <= 2, so |A_ij| <= 2. fp16 rounds an entry
# to 2^-12 of itself, under the 2^-9 of the bf16 operands A's products already carry (entries below
# 2^-24 flush, against P's unit diagonal), and halves the 256 bytes a token-head that this kernel
# (and the wide-block rewrite) writes and the inverse reads (docs/notes/kda-prefill.md v32). Raw
# beta, raw keys and a given gate keep fp32. Measured on an H100 (kda_prefill_sweep-v32-a16-h100.json):
# -2.1% on the calls that store the gated tiles (H96 1x8k 1191 -> 1167 us, the H64 varlen batch
# 1489 -> 1457; the softplus gate at 1x8k H64 -0.7%), but +3.6% under the gaters' scan at 1x8k H64
# (719 -> 745: the prologue +15 us, the inverse with P diag(beta) +4; 2x16k -0.4%), so only the
# gated-tiles calls take it. False: fp32 everywhere
A_FP16 = True
# A dense batch with T a multiple of 64 (every chunk whole) without row masks on the gate's activation
# and the stores (FULL): the slice loop's masked stores recompute a predicate a row at each store.
# H200 (v21): within the noise alone (+1.0% at 1x8k H64, -0.4% at 2x16k), part of the fastest build
FULL_CHUNKS = True


def serves(p) -> str | None:
    """None when this prologue serves the problem, else why not (the Triton prologue then does)."""
    from fastla.backends.triton.chunk_prepare_kda import bounded_spans

    if not bounded_spans(p) and not UNBOUNDED:
        return "the gate is not the bounded one computed in the op (lower_bound >= -5; UNBOUNDED off)"
    if p.K % 32:
        return f"K = {p.K} is not a multiple of 32"
    if p.gk.dtype not in (torch.bfloat16, torch.float32):
        return f"the gate is {p.gk.dtype}, not bf16 or fp32 (TMA tiles)"
    return None


def launch(p, beta, beta_mode: int, total: int, tables, inverse, scores, kg, kd, qg, decay, rq=None, rk=None,
           beta_cols: bool = False) -> None:
    """Runs the prologue over ``total`` chunks (``tables`` = (cu_seqlens, chunk index) or Nones):
    P into ``inverse`` and Aqk into ``scores`` ``[B, T, HV, 64]``, the gated keys and queries into
    ``kg``, ``kd``, ``qg`` ``[B, T, HV, K]``, e^(G_last) into ``decay`` ``[total, HV, K]``. For GLA
    (``p.delta`` False: no beta, A, kg nor inverse) Aqk, kd, qg and decay. ``kg``, ``kd`` and ``qg``
    None: the scan forms them (gluon/chunk_delta.gates_in_scan; the bounded gate only), and with
    the l2norm in the op 1 / |q| and 1 / |k| go to ``rq``, ``rk`` ``[B, T, H]``. ``beta_cols``:
    P diag(beta) instead of P (triton_chunk.run's ``beta_in_p``)."""
    from fastla.backends.gluon.chunk_delta import _tile_layout, tma_descriptor
    from fastla.backends.gluon import chunk_inverse_sm90
    from fastla.backends.triton import chunk_prepare_kda, chunk_prepare_kda_wide
    from fastla.backends.triton import sm_count
    from fastla.backends.triton.launch import launcher

    def desc(x, heads):                      # [B * T, heads * K] in [64, 32] boxes (rows past B * T: zeros)
        return tma_descriptor(x, p.B * p.T, heads * p.K, [64, 32], _tile_layout(64, 32, x.dtype == torch.float32))

    cu, chunk_index = tables
    varlen = cu is not None
    NT = -(-p.T // 64)
    flag = not chunk_prepare_kda.bounded_spans(p)           # unbounded spans: flag the blocks past SPAN_LIMIT
    gated = kg is not None
    bounded_a = chunk_prepare_kda.decaying_gate(p) and p.use_qk_l2norm and beta_mode >= 2     # |A| <= 2
    a_dtype = torch.float16 if A_FP16 and bounded_a and gated else torch.float32
    a_kk = call_plan.empty((p.B, p.T, p.HV, 64), a_dtype, p.device) if p.delta else decay    # (GLA: no A)
    if not gated and (flag or not p.delta):
        raise ValueError("the scan forms the gated keys for KDA's bounded gate only")
    if not gated:
        kg = kd = qg = decay
    if beta_cols and not p.delta:
        raise ValueError("P diag(beta) is the delta rule's (GLA has no P)")
    if not gated and p.use_qk_l2norm and (rq is None or rk is None):
        raise ValueError("the scan's gated keys need the rows' norms: rq and rk")
    flags = call_plan.empty((total, p.HV), torch.int32, p.device) if flag else decay
    items = total * p.HV
    programs = min(items, PROGRAMS_PER_SM * sm_count(p.device)) if PROGRAMS_PER_SM else items
    from_x = BOUNDED_OPERANDS and not flag and p.use_qk_l2norm
    launcher(_kda_prologue_sm90_kernel, p.T, NT)[(programs,)](
        desc(p.q, p.H), desc(p.k, p.H), desc(p.gk, p.HV), beta, p.A_log if p.A_log is not None else decay,
        p.dt_bias if p.dt_bias is not None else decay, float(p.lower_bound or 0.0), p.scale,
        a_kk, scores, kg, kd, qg, decay, flags, rq if rq is not None else decay, rk if rk is not None else decay,
        cu if varlen else decay, chunk_index if varlen else decay, p.T, NT,
        total, H=p.H, HV=p.HV, K=p.K, L2NORM=p.use_qk_l2norm, GATE=chunk_prepare_kda.gate_mode(p),
        HAS_A=p.A_log is not None, HAS_BIAS=p.dt_bias is not None, BETA=beta_mode, VARLEN=varlen, FLAG=flag,
        QK_BUFFERS=2 if p.gk.dtype == torch.bfloat16 else 1, DELTA=p.delta,
        FROM_X=from_x, FULL=FULL_CHUNKS and not varlen and p.T % 64 == 0,
        GATED=gated, AHEAD=LOADS_AHEAD and from_x, num_warps=4,
        **({"maxnreg": MAXNREG} if MAXNREG and p.K == 128 else {}),
    )
    if flag:                                                # the flagged blocks again, exactly
        chunk_prepare_kda_wide.launch(p, beta, beta_mode, total, tables, a_kk, scores, kg, kd, qg, flags)
    cols = {"beta": beta, "beta_mode": beta_mode} if beta_cols else {}
    if p.delta and INVERSE_SM90:    # (GLA, the plain rule, reads Aqk, qg, kd and decay only)
        chunk_inverse_sm90.launch_kda(p, total, tables, a_kk, inverse, **cols)
    elif p.delta:
        chunk_prepare_kda.launch_inverse(p, total, tables, a_kk, inverse, INVERSE_WARPS, **cols)
