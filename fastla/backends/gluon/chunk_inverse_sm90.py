"""Hopper (sm_90) inverse kernel of the GDN prologue: Gluon, the Triton inverse kernel's contract
and algorithm (backends/triton/chunk_prepare.py, ``_inverse_kernel``) with explicit layouts, so that
the four diagonal blocks' substitution runs by columns (no reductions across lanes) and every
scratch stays in shared memory.

Per 64-token chunk and value head, with G = cumsum(g) over the chunk and unit keys (l2norm in the
op) or raw keys:
    A = strict_lower(beta_i (k_i . k_j) rk_i rk_j e^(G_i - G_j))   [64, 64],   P = (I + A)^-1
written as P ``[B, T, HV, 64]`` (bf16 whole rows, zeros above the block diagonal) and G
``[B, T, HV]`` (fp32). NORMS (the scores formed in the scan, gluon/chunk_delta.scores_in_scan):
also 1 / |k| and 1 / |q| ``[B, T, H]`` by the first program of each q/k head, the keys' from
the Gram diagonals and the queries' from the diagonal blocks of their own Gram, the queries
loaded by TMA into the keys' tiles once the keys' Gram is done (+~400 SASS instructions a program,
one more TMA round trip; measured +14-24% on the kernel, docs/notes/gdn-prefill.md v32).
BETA_COLS (the same plan, gluon/chunk_delta.BETA_IN_P): P diag(beta) instead of P, each block's
columns scaled before the one bf16 rounding, so that the scan's Y skips beta.

Grid ``(chunks, HV / VPP)``, one warp: a program takes one chunk of VPP value heads sharing a q/k
head. The chunk's keys by TMA ([64, 64] boxes); the ten lower [16, 16] Gram blocks K_b K_c^T by
mma.sync (bf16, fp32 accumulation; the key norms from their diagonals). Per value head: the gate,
beta and G ([64] vectors, G by a scan), A's ten blocks; the diagonal blocks' inverses D_b by
column substitution: A_b^T goes to shared memory, a thread holds one column of two blocks with
its 16 rows in registers, and step j reads column j of A_b as a broadcast and updates the rows
with 16 FMAs (15 steps); the six blocks below by block forward substitution on tf32 mma.sync,
P_bc = -D_b sum_(c <= d < b) A_bd P_dc (the Triton kernel's products); P assembled in shared
memory and stored in 16-byte runs.

Budget (K = 128, sm_90, aligned pointers as launched): 255 registers with 104 bytes of stack at
four heads a program (one head: 168 registers, 8 bytes), 17.5 KB of shared memory (the diagonal
blocks' scratch on the keys' second slice once the Gram is done): eight one-warp programs an SM at
four heads (registers), twelve at one. Measured (H200, docs/notes/gdn-prefill.md v18): 8-12% faster
than the Triton kernel before the scratch moved (1x32k HV64 397 -> 363 us, 4x8k HV32 243 -> 214),
still latency-bound.

KDA's inverse (``_kda_inverse_sm90_kernel``, on by default: chunk_prepare_kda_sm90.INVERSE_SM90):
the same from A's blocks on, A read from the fp32 (fp16 where |A| <= 2) ``[B, T, HV, 64]`` the
KDA sm_90 prologue writes (beta applied) instead of formed from keys. Grid (chunks, HV), one warp;
sm_90 compile: 152-168 registers, no spill, 16 KB of shared memory (bf16 P), ~1 s to compile
against the Triton kernel's 3.6-4.3 s (its Coalesce pass alone takes 2 s on the 60 unrolled row
loads).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from fastla.backends.triton.chunk_index import _chunk
from fastla.backends.triton.chunk_prepare import _activate_beta, _gdn_gate

LOG2E = gl.constexpr(1.4426950408889634)
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
ROWS = gl.constexpr(gl.SliceLayout(1, MMA))
COLS = gl.constexpr(gl.SliceLayout(0, MMA))
CS = gl.constexpr(gl.BlockedLayout([1, 1, 16], [2, 16, 1], [1, 1, 1], [2, 1, 0]))   # [4, 16, 16] by columns
OUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0]))                # P's rows in 16-byte runs
PLAIN2 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
PLAIN3 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _mm(a, b):
    """[16, 16] x [16, 16] on tf32 mma.sync, fp32 accumulation (the Triton kernel's merge precision);
    an operand already in its dot layout is taken as it is."""
    ta: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1)
    tb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=1)
    return mma_v2(gl.convert_layout(a, ta), gl.convert_layout(b, tb), gl.zeros([16, 16], gl.float32, MMA),
                  input_precision="tf32")


@gluon.jit
def _gram(k_s, b: gl.constexpr, c: gl.constexpr, NK: gl.constexpr):
    """K_b K_c^T [16, 16] over the NK [64, 64] key slices in shared memory (bf16 mma.sync)."""
    da: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    db: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    acc = gl.zeros([16, 16], gl.float32, MMA)
    for kk in gl.static_range(NK):
        kt = k_s.index(kk)
        acc = mma_v2(kt.slice(16 * b, 16, dim=0).load(da), kt.slice(16 * c, 16, dim=0).permute((1, 0)).load(db), acc)
    return acc


@gluon.jit
def _a_block(gram, scale_r, rk_c, G_r, G_c, DIAG: gl.constexpr, EXP2: gl.constexpr):
    """A's block from a Gram block [16, 16]: scale_r = beta rk of the rows, rk_c of the columns,
    e^(G_i - G_j); strictly lower on a diagonal block (the exponent clamped where unused). EXP2
    (INVERSE_EXP2): e^x as 2^(x log2 e) on ex2.approx.ftz, where gl.exp's ex2.approx also rescales
    exponents below -126 for subnormal results (a compare and two predicated multiplies an element;
    results below 2^-126 go to 0: no factor of A that counts)."""
    d = G_r[:, None] - G_c[None, :]
    if EXP2:
        d = d * LOG2E
    x = gram * scale_r[:, None] * rk_c[None, :]
    if DIAG:
        r = gl.arange(0, 16, layout=ROWS)[:, None]
        c = gl.arange(0, 16, layout=COLS)[None, :]
        if EXP2:
            x = gl.where(r > c, x * gl.exp2(gl.where(r > c, d, 0.0)), 0.0)
        else:
            x = gl.where(r > c, x * gl.exp(gl.where(r > c, d, 0.0)), 0.0)
    elif EXP2:
        x = x * gl.exp2(d)
    else:
        x = x * gl.exp(d)
    return x


@gluon.jit
def _block_row(buf, b: gl.constexpr, layout: gl.constexpr):
    """Row b of a [4, 16] shared buffer as a [16] vector in ``layout``."""
    x = buf.slice(b, 1, dim=0).load(gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0]))
    return gl.convert_layout(gl.reshape(x, [16]), layout)


@gluon.jit
def _store_block(buf, b: gl.constexpr, x):
    """x [16, 16] into block b of a [4, 16, 16] shared buffer."""
    buf.slice(b, 1, dim=0).store(gl.reshape(x, [1, 16, 16]))


@gluon.jit
def _store_p(p_s, b: gl.constexpr, c: gl.constexpr, x, bv_s, BETA_COLS: gl.constexpr):
    """P's block (b, c) [16, 16] (mma layout) into p_s [64, 64] bf16; BETA_COLS: times beta of
    block c's tokens on its columns (bv_s [4, 16]) before the one rounding."""
    if BETA_COLS:
        x = x * _block_row(bv_s, c, COLS)[None, :]
    p_s.slice(16 * b, 16, dim=0).slice(16 * c, 16, dim=1).store(x.to(gl.bfloat16))


@gluon.jit
def _load_block_t(buf, b: gl.constexpr):
    """The transpose of block b [16, 16] of a [4, 16, 16] shared buffer, in the mma layout."""
    x = buf.slice(b, 1, dim=0).load(gl.BlockedLayout([1, 1, 4], [1, 4, 8], [1, 1, 1], [2, 1, 0]))
    return gl.convert_layout(gl.permute(gl.reshape(x, [16, 16]), (1, 0)), MMA)


@gluon.jit
def _diagonal_inverses(dg_s, dp_s, CS: gl.constexpr):
    """D_b = (I + A_b)^-1 of the four strictly lower diagonal blocks, A_b^T in dg_s [4, 16 (j), 16 (i)]:
    by columns (x = e_c, then x_i -= A_b[i, j] x_j for j = 0 .. 14; A_b[i, j] = 0 for i <= j, so every
    row is updated), a column's 16 rows in one thread (layout CS). Leaves D_b^T in dp_s [4, c, i]."""
    ci = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, CS)))[None, :, None]   # [1, 16, 1] column
    ii = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, CS)))[None, None, :]   # [1, 1, 16] row
    X = gl.where(ii == ci, 1.0, 0.0) + gl.zeros([4, 16, 16], gl.float32, CS)
    for j in gl.static_range(15):
        a_j = dg_s.slice(j, 1, dim=1).load(CS)                              # [4, 1, 16]: A_b[i, j]
        x_j = gl.sum(gl.where(ii == j, X, 0.0), 2)                          # [4, 16]: x_j of each column
        X = X - a_j * gl.expand_dims(x_j, 2)
    dp_s.store(X)


@gluon.jit
def _lower_inverse(dp_s, dT, a10, a20, a21, a30, a31, a32, DIRECT: gl.constexpr):
    """P's ten lower blocks: the diagonal ones D_b from dp_s (D_b^T, _diagonal_inverses), the six
    below by block forward substitution P_bc = -P_bb sum_(c <= d < b) A_bd P_dc from A's lower
    blocks a_bc (tf32 mma.sync). DIRECT (INVERSE_DIRECT_OPERANDS): the diagonal blocks loaded from
    dT (dp_s as [64, 16], D_b^T in rows 16b .. 16b + 15) straight into the operand layouts they
    are used in, instead of converted from the accumulator layout; the same products."""
    p00 = _load_block_t(dp_s, 0)                                            # D_b [16, 16]
    p11 = _load_block_t(dp_s, 1)
    p22 = _load_block_t(dp_s, 2)
    p33 = _load_block_t(dp_s, 3)
    # each diagonal block as a left operand (x1a ..) and a right one (x0b ..); _mm converts
    # whatever is not yet in its operand layout
    if DIRECT:
        ta: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1)
        tb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=1)
        x0b = dT.slice(0, 16, dim=0).permute((1, 0)).load(tb)
        x1a = dT.slice(16, 16, dim=0).permute((1, 0)).load(ta)
        x1b = dT.slice(16, 16, dim=0).permute((1, 0)).load(tb)
        x2a = dT.slice(32, 16, dim=0).permute((1, 0)).load(ta)
        x2b = dT.slice(32, 16, dim=0).permute((1, 0)).load(tb)
        x3a = dT.slice(48, 16, dim=0).permute((1, 0)).load(ta)
    else:
        x0b, x1a, x1b, x2a, x2b, x3a = p00, p11, p11, p22, p22, p33
    p10 = -_mm(x1a, _mm(a10, x0b))
    p21 = -_mm(x2a, _mm(a21, x1b))
    p32 = -_mm(x3a, _mm(a32, x2b))
    p20 = -_mm(x2a, _mm(a20, x0b) + _mm(a21, p10))
    p31 = -_mm(x3a, _mm(a31, x1b) + _mm(a32, p21))
    p30 = -_mm(x3a, _mm(a30, x0b) + _mm(a31, p10) + _mm(a32, p20))
    return p00, p10, p11, p20, p21, p22, p30, p31, p32, p33


@gluon.jit(do_not_specialize=["T", "NT"])
def _gdn_inverse_sm90_kernel(
    k_desc, q_desc, g, beta, A_log, dt_bias, p_out, gcum, rq_out, rk_out, cu_seqlens, chunk_index, T, NT,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, VPP: gl.constexpr, L2NORM: gl.constexpr,
    GATE: gl.constexpr, HAS_BIAS: gl.constexpr, BETA: gl.constexpr, VARLEN: gl.constexpr, EXP2: gl.constexpr,
    DIRECT: gl.constexpr, NORMS: gl.constexpr, BETA_COLS: gl.constexpr,
):
    gl.static_assert(K % 64 == 0, "K in [64, 64] boxes")
    NK: gl.constexpr = K // 64
    vec_l: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])             # [64] token vectors

    i_c = gl.program_id(0).to(gl.int64)
    hv0 = gl.program_id(1) * VPP                                            # VPP value heads of one q/k head
    i_h = hv0 // (HV // H)
    i_n, c_seq, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c_seq * 64                                                   # first token (int64)
    n_left = eos - t0                                                       # tokens of the chunk from t0, >= 1

    k_s = gl.allocate_shared_memory(gl.bfloat16, [NK, 64, 64], k_desc.layout)
    if NK >= 2:   # A_b^T of the diagonal blocks and D_b^T where the keys' second slice was (after the Gram)
        scratch = k_s._reinterpret(gl.float32, [8 * NK, 16, 16], PLAIN3)   # [16, 16] fp32 blocks, 1 KB each
        dg_s = scratch.slice(8, 4, dim=0)
        dp_s = scratch.slice(12, 4, dim=0)
        dT = k_s._reinterpret(gl.float32, [8 * NK * 16, 16], PLAIN2).slice(12 * 16, 64, dim=0)   # dp_s as [64, 16]
    else:
        dg_s = gl.allocate_shared_memory(gl.float32, [4, 16, 16], PLAIN3)
        dp_s = gl.allocate_shared_memory(gl.float32, [4, 16, 16], PLAIN3)
        dT = dp_s._reinterpret(gl.float32, [64, 16], PLAIN2)
    gv_s = gl.allocate_shared_memory(gl.float32, [4, 16], PLAIN2)           # G by blocks
    bv_s = gl.allocate_shared_memory(gl.float32, [4, 16], PLAIN2)           # beta by blocks
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    mbarrier.expect(bar, NK * 64 * 64 * 2)
    for kk in gl.static_range(NK):
        tma.async_copy_global_to_shared(k_desc, [t0.to(gl.int32), i_h * K + kk * 64], bar, k_s.index(kk))
    mbarrier.wait(bar, 0)
    if not NORMS:
        mbarrier.invalidate(bar)

    # the ten lower Gram blocks [16, 16] and the key norms from the diagonal ones
    g00 = _gram(k_s, 0, 0, NK)
    g10 = _gram(k_s, 1, 0, NK)
    g11 = _gram(k_s, 1, 1, NK)
    g20 = _gram(k_s, 2, 0, NK)
    g21 = _gram(k_s, 2, 1, NK)
    g22 = _gram(k_s, 2, 2, NK)
    g30 = _gram(k_s, 3, 0, NK)
    g31 = _gram(k_s, 3, 1, NK)
    g32 = _gram(k_s, 3, 2, NK)
    g33 = _gram(k_s, 3, 3, NK)
    o16 = gl.arange(0, 16, layout=ROWS)
    eye = o16[:, None] == gl.arange(0, 16, layout=COLS)[None, :]
    # NORMS (the scores formed in the scan): the first program of each q/k head writes 1 / |k| and
    # 1 / |q| of the chunk's rows, the queries' from the Gram diagonals of their tiles, loaded by TMA
    # where the keys were
    first = gl.program_id(1) % (HV // H // VPP) == 0
    if NORMS:
        gl.thread_barrier()                                                 # (the keys' reads are done)
        fence_async_shared()
        mbarrier.expect(bar, NK * 64 * 64 * 2)
        for kk in gl.static_range(NK):
            tma.async_copy_global_to_shared(q_desc, [t0.to(gl.int32), i_h * K + kk * 64], bar, k_s.index(kk))
        mbarrier.wait(bar, 1)
        for b in gl.static_range(4):
            rq = gl.rsqrt(gl.sum(gl.where(eye, _gram(k_s, b, b, NK), 0.0), 1) + 1e-6)
            gl.store(rq_out + (t0 + 16 * b + o16) * H + i_h, rq, mask=first & (o16 + 16 * b < n_left))
        mbarrier.invalidate(bar)
    if L2NORM:
        r0 = gl.rsqrt(gl.sum(gl.where(eye, g00, 0.0), 1) + 1e-6)            # [16] rows
        r1 = gl.rsqrt(gl.sum(gl.where(eye, g11, 0.0), 1) + 1e-6)
        r2 = gl.rsqrt(gl.sum(gl.where(eye, g22, 0.0), 1) + 1e-6)
        r3 = gl.rsqrt(gl.sum(gl.where(eye, g33, 0.0), 1) + 1e-6)
        if NORMS:
            gl.store(rk_out + (t0 + o16) * H + i_h, r0, mask=first & (o16 < n_left))
            gl.store(rk_out + (t0 + 16 + o16) * H + i_h, r1, mask=first & (o16 + 16 < n_left))
            gl.store(rk_out + (t0 + 32 + o16) * H + i_h, r2, mask=first & (o16 + 32 < n_left))
            gl.store(rk_out + (t0 + 48 + o16) * H + i_h, r3, mask=first & (o16 + 48 < n_left))
    else:
        r0 = gl.full([16], 1.0, gl.float32, ROWS)
        r1 = r0
        r2 = r0
        r3 = r0
    # P is assembled where the keys were (8 KB; zeros above the block diagonal, written once)
    gl.thread_barrier()
    p_s = k_s._reinterpret(gl.bfloat16, [64, 64], PLAIN2)
    p_s.store(gl.zeros([64, 64], gl.bfloat16, OUT))
    c0 = gl.convert_layout(r0, COLS)                                        # the same as columns' vectors
    c1 = gl.convert_layout(r1, COLS)
    c2 = gl.convert_layout(r2, COLS)
    c3 = gl.convert_layout(r3, COLS)

    o_t = gl.arange(0, 64, layout=vec_l)
    m_t = o_t < n_left
    r_o = gl.arange(0, 64, layout=gl.SliceLayout(1, OUT))[:, None]
    c_o = gl.arange(0, 64, layout=gl.SliceLayout(0, OUT))[None, :]
    for jv in range(VPP):
        i_hv = hv0 + jv
        base = t0 * HV + i_hv                                               # chunk row 0 in g, beta, gcum
        x = gl.load(g + base + o_t * HV, mask=m_t, other=0.0).to(gl.float32)
        if GATE:
            x = _gdn_gate(x, m_t, A_log, dt_bias, i_hv, HAS_BIAS)
        bt = _activate_beta(gl.load(beta + base + o_t * HV, mask=m_t, other=0.0), m_t, BETA)
        G = gl.associative_scan(x, 0, _add)                                 # [64] cumsum
        gl.store(gcum + base + o_t * HV, G, mask=m_t)
        gl.thread_barrier()                                                 # (the last head's reads are done)
        gv_s.store(gl.reshape(G, [4, 16]))
        bv_s.store(gl.reshape(bt, [4, 16]))
        gl.thread_barrier()
        G0 = _block_row(gv_s, 0, ROWS)
        G1 = _block_row(gv_s, 1, ROWS)
        G2 = _block_row(gv_s, 2, ROWS)
        G3 = _block_row(gv_s, 3, ROWS)
        H0 = _block_row(gv_s, 0, COLS)
        H1 = _block_row(gv_s, 1, COLS)
        H2 = _block_row(gv_s, 2, COLS)
        H3 = _block_row(gv_s, 3, COLS)
        s0 = _block_row(bv_s, 0, ROWS) * r0                                 # beta rk of each block's rows
        s1 = _block_row(bv_s, 1, ROWS) * r1
        s2 = _block_row(bv_s, 2, ROWS) * r2
        s3 = _block_row(bv_s, 3, ROWS) * r3

        a00 = _a_block(g00, s0, c0, G0, H0, True, EXP2)
        a11 = _a_block(g11, s1, c1, G1, H1, True, EXP2)
        a22 = _a_block(g22, s2, c2, G2, H2, True, EXP2)
        a33 = _a_block(g33, s3, c3, G3, H3, True, EXP2)
        _store_block(dg_s, 0, gl.permute(a00, (1, 0)))
        _store_block(dg_s, 1, gl.permute(a11, (1, 0)))
        _store_block(dg_s, 2, gl.permute(a22, (1, 0)))
        _store_block(dg_s, 3, gl.permute(a33, (1, 0)))
        gl.thread_barrier()
        _diagonal_inverses(dg_s, dp_s, CS)
        a10 = _a_block(g10, s1, c0, G1, H0, False, EXP2)
        a21 = _a_block(g21, s2, c1, G2, H1, False, EXP2)
        a32 = _a_block(g32, s3, c2, G3, H2, False, EXP2)
        a20 = _a_block(g20, s2, c0, G2, H0, False, EXP2)
        a31 = _a_block(g31, s3, c1, G3, H1, False, EXP2)
        a30 = _a_block(g30, s3, c0, G3, H0, False, EXP2)
        gl.thread_barrier()
        p00, p10, p11, p20, p21, p22, p30, p31, p32, p33 = _lower_inverse(dp_s, dT, a10, a20, a21, a30, a31, a32,
                                                                          DIRECT)
        _store_p(p_s, 0, 0, p00, bv_s, BETA_COLS)
        _store_p(p_s, 1, 0, p10, bv_s, BETA_COLS)
        _store_p(p_s, 1, 1, p11, bv_s, BETA_COLS)
        _store_p(p_s, 2, 0, p20, bv_s, BETA_COLS)
        _store_p(p_s, 2, 1, p21, bv_s, BETA_COLS)
        _store_p(p_s, 2, 2, p22, bv_s, BETA_COLS)
        _store_p(p_s, 3, 0, p30, bv_s, BETA_COLS)
        _store_p(p_s, 3, 1, p31, bv_s, BETA_COLS)
        _store_p(p_s, 3, 2, p32, bv_s, BETA_COLS)
        _store_p(p_s, 3, 3, p33, bv_s, BETA_COLS)
        gl.thread_barrier()
        gl.store(p_out + (base + r_o * HV) * 64 + c_o, p_s.load(OUT), mask=r_o < n_left)


@gluon.jit
def _lower_block(a, base, bi: gl.constexpr, bj: gl.constexpr, n_left, HV: gl.constexpr):
    """Block (bi, bj) [16, 16] of a chunk's A ``[rows, HV, 64]`` (its row 0 at a + base 64) in the
    mma layout, fp32, zero past the chunk's rows."""
    r = gl.arange(0, 16, layout=ROWS)[:, None] + 16 * bi
    c = gl.arange(0, 16, layout=COLS)[None, :] + 16 * bj
    return gl.load(a + (base + r * HV) * 64 + c, mask=r < n_left, other=0.0).to(gl.float32)


@gluon.jit
def _beta_columns(beta, base, c: gl.constexpr, n_left, HV: gl.constexpr, BETA: gl.constexpr):
    """beta of column block c's 16 tokens [1, 16] in the mma layout (activated; 0 past the chunk)."""
    t = 16 * c + gl.arange(0, 16, layout=COLS)
    return _activate_beta(gl.load(beta + base + t * HV, mask=t < n_left, other=0.0), t < n_left, BETA)[None, :]


@gluon.jit(do_not_specialize=["T", "NT"])
def _kda_inverse_sm90_kernel(a, p_out, beta, cu_seqlens, chunk_index, T, NT, HV: gl.constexpr,
                             VARLEN: gl.constexpr, BETA: gl.constexpr, BETA_COLS: gl.constexpr):
    """KDA's P = (I + A)^-1 per chunk and value head from the strictly lower A (beta applied, fp32
    or fp16 ``[B, T, HV, 64]``, chunk_prepare_kda_sm90.A_FP16) that the sm_90 prologue writes: the
    contract of the Triton kernel (chunk_prepare_kda._kda_inverse_kernel, whole rows of P with zeros
    above the block diagonal, the chunk's rows only), the algorithm of _gdn_inverse_sm90_kernel
    from A's blocks on: the diagonal blocks by column substitution in shared memory, the six below
    by tf32 mma.sync. Grid (chunks, HV), one warp; 8 KB of shared memory for the blocks' scratch,
    8 KB for P (bf16).
    BETA_COLS: P diag(beta) (beta activated as BETA numbers it, loaded first), each block's columns
    scaled before the one rounding."""
    ld3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [1, 1, 1], [2, 1, 0])    # [4, 16, 16] rows of A

    i_c = gl.program_id(0).to(gl.int64)
    i_hv = gl.program_id(1)
    i_n, c_seq, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c_seq * 64                                                   # first token (int64)
    n_left = eos - t0                                                       # tokens of the chunk from t0, >= 1
    base = t0 * HV + i_hv                                                   # the chunk's row 0 in A and P
    if BETA_COLS:
        e = (_beta_columns(beta, base, 0, n_left, HV, BETA), _beta_columns(beta, base, 1, n_left, HV, BETA),
             _beta_columns(beta, base, 2, n_left, HV, BETA), _beta_columns(beta, base, 3, n_left, HV, BETA))

    dg_s = gl.allocate_shared_memory(gl.float32, [4, 16, 16], PLAIN3)
    dp_s = gl.allocate_shared_memory(gl.float32, [4, 16, 16], PLAIN3)
    p_s = gl.allocate_shared_memory(p_out.dtype.element_ty, [64, 64], PLAIN2)
    p_s.store(gl.zeros([64, 64], p_out.dtype.element_ty, OUT))
    # the diagonal blocks A_b [b, i, j] (strictly lower: A_b[i, j] = 0 for i <= j), as A_b^T [b, j, i]
    bb = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, ld3)))[:, None, None]
    ii = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, ld3)))[None, :, None]
    jj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, ld3)))[None, None, :]
    rows = 16 * bb + ii                                                     # [4, 16, 1]
    x = gl.load(a + (base + rows * HV) * 64 + 16 * bb + jj, mask=(rows < n_left) & (jj < ii), other=0.0)
    dg_s.store(gl.permute(x.to(gl.float32), (0, 2, 1)))
    gl.thread_barrier()
    _diagonal_inverses(dg_s, dp_s, CS)
    a10 = _lower_block(a, base, 1, 0, n_left, HV)
    a20 = _lower_block(a, base, 2, 0, n_left, HV)
    a21 = _lower_block(a, base, 2, 1, n_left, HV)
    a30 = _lower_block(a, base, 3, 0, n_left, HV)
    a31 = _lower_block(a, base, 3, 1, n_left, HV)
    a32 = _lower_block(a, base, 3, 2, n_left, HV)
    gl.thread_barrier()
    p00, p10, p11, p20, p21, p22, p30, p31, p32, p33 = _lower_inverse(dp_s, dp_s, a10, a20, a21, a30, a31, a32,
                                                                      False)
    blocks = (p00, p10, p11, p20, p21, p22, p30, p31, p32, p33)             # row b's blocks from b (b + 1) / 2
    for b in gl.static_range(4):
        for c in gl.static_range(b + 1):
            x = blocks[b * (b + 1) // 2 + c]
            if BETA_COLS:
                x = x * e[c]
            p_s.slice(16 * b, 16, dim=0).slice(16 * c, 16, dim=1).store(x.to(p_s.dtype))
    gl.thread_barrier()
    r_o = gl.arange(0, 64, layout=gl.SliceLayout(1, OUT))[:, None]
    c_o = gl.arange(0, 64, layout=gl.SliceLayout(0, OUT))[None, :]
    gl.store(p_out + (base + r_o * HV) * 64 + c_o, p_s.load(OUT), mask=r_o < n_left)


def launch_kda(p, total: int, tables, a, inverse, beta=None, beta_mode: int = 0) -> None:
    """chunk_prepare_kda.launch_inverse's contract: P = (I + A)^-1 into ``inverse`` ``[B, T, HV, 64]``
    from the fp32 or fp16 A of the sm_90 prologue; with ``beta`` ``[B, T, HV]`` (activated as
    ``beta_mode`` numbers it), P diag(beta)."""
    from fastla.backends.triton.launch import launcher

    cu, chunk_index = tables
    varlen = cu is not None
    NT = -(-p.T // 64)
    launcher(_kda_inverse_sm90_kernel, p.T, NT)[(total, p.HV)](
        a, inverse, beta if beta is not None else a, cu if varlen else a, chunk_index if varlen else a, p.T, NT,
        HV=p.HV, VARLEN=varlen, BETA=beta_mode, BETA_COLS=beta is not None, num_warps=1)


def launch(p, g, beta, beta_mode: int, total: int, tables, gcum, inverse, dot, config, rq=None, rk=None,
           beta_cols: bool = False) -> None:
    """chunk_prepare.launch's contract (``dot`` unused: bf16 keys): G into ``gcum`` ``[B, T, HV]``
    and P into ``inverse`` ``[B, T, HV, 64]``; value heads a program by chunk_prepare's rule.
    With ``rq``, ``rk`` (the l2norm in the op and the scores formed in the scan, so that no scores
    kernel writes them): 1 / |q| and 1 / |k| into them ``[B, T, H]``. ``beta_cols``: P diag(beta)
    instead of P (triton_chunk.run's ``beta_in_p``: the scan's Y then skips beta)."""
    from fastla.backends.gluon.chunk_delta import (
        INVERSE_DIRECT_OPERANDS, INVERSE_EXP2, _tile_layout, tma_descriptor,
    )
    from fastla.backends.triton import sm_count
    from fastla.backends.triton.chunk_prepare import values_per_program
    from fastla.backends.triton.launch import launcher

    cu, chunk_index = tables
    varlen = cu is not None
    NT = -(-p.T // 64)
    vpp = values_per_program(p.HV // p.H, config.inverse_heads, total * p.HV, sm_count(p.device))
    d = gcum
    norms = rq is not None
    if norms and not p.use_qk_l2norm:
        raise RuntimeError("the inverse kernel writes 1 / |q| and 1 / |k| only with the l2norm in the op")
    def desc(x):
        return tma_descriptor(x, p.B * p.T, p.H * p.K, [64, 64], _tile_layout(64, 64))

    k = desc(p.k)
    launcher(_gdn_inverse_sm90_kernel, p.T, NT)[(total, p.HV // vpp)](
        k, desc(p.q) if norms else k, g, beta,
        p.A_log if p.A_log is not None else d, p.dt_bias if p.dt_bias is not None else d, inverse, gcum,
        rq if norms else d, rk if norms else d, cu if varlen else d, chunk_index if varlen else d, p.T, NT,
        H=p.H, HV=p.HV, K=p.K, VPP=vpp, L2NORM=p.use_qk_l2norm, GATE=p.gate_in_op == "gdn",
        HAS_BIAS=p.dt_bias is not None, BETA=beta_mode, VARLEN=varlen, EXP2=INVERSE_EXP2,
        DIRECT=INVERSE_DIRECT_OPERANDS, NORMS=norms, BETA_COLS=beta_cols, num_warps=1,
    )
