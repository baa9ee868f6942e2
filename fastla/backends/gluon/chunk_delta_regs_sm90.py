"""Hopper (sm_90) chunk scan of the GDN and KDA forwards with the state and the step's intermediates in registers.

The same function as chunk_delta_sm90.py (its prologue, tiles and row vectors) with every product
transposed, so that the operands that change each step are wgmma A operands held in registers
instead of bf16 tiles written to shared memory, fenced and waited for at a barrier. A chain (one
warpgroup) owns BV = 64 value columns of one value head (the wgmma M side); its state
``S^T [BV, K]`` fp32 is one accumulator in registers. Per chunk (the tiles landed):
    X^T = S^T k^T  and  Q^T = S^T q^T       A = S^T (bf16 registers), B = the key / query tile, permuted
    Y^T = (v^T - X^T diag(rk e^G)) diag(beta)      v^T read from the value tile, permuted
    V_new^T = Y^T P^T                        A = Y^T (registers)
    S^T = e^G_last S^T + V_new^T diag(rk e^(G_last - G)) k      A = registers, B = the key tile
    O^T = Q^T diag(scale rq e^G) + V_new^T A_qk^T                 A = V_new^T (registers)
    O (transposed into shared memory) -> TMA store
BETA_IN_P (where QK or GATES plans it, gluon/chunk_delta.BETA_IN_P): the inverse kernel wrote P
diag(beta), so Y^T = v^T - X^T diag(rk e^G) and the loader loads no beta.
GK (KDA): kg, qg and kd tiles per value head; Y^T = (v^T - S^T kg^T) diag(beta), S^T = S^T
diag(e^G_last) + V_new^T diag(mask) kd, O^T = S^T qg^T + V_new^T diag(mask) A_qk^T. Each product
is one wgmma op over its whole K (the keys' two [64, 64] TMA boxes read as one [64, K] tile): an
accumulator chained from one op into the next makes ptxas wait for the first (C7517). The
per-token vectors are column vectors here (16 registers a thread each), so the loader computes
them into shared memory and the chain loads each where it is used; the only shared-memory writes
of a chain's step are its output tile's, and it meets the loader only at the stage mbarriers.

Grid ``(sequences or segments x HV x V / (64 CHAINS),)`` (chunk_delta_sm90._program); CHAINS
chains (4 warps each: the default partition and, with two, a worker) and a one-warp loader
(chunk_delta_dual_sm90._load_stage: the chunk's tiles, one value tile a chain; then the per-token
vectors: rk e^G, beta, rk e^(G_last - G), scale rq e^G, or with GK beta, the rows' mask and the
chunk's decays [K]). Two chains share the chunk's key, query, P and A_qk tiles and its vectors.
QK (GDN, gluon/chunk_delta.SCORES_IN_SCAN): A_qk formed from Q K^T (one more wgmma over the
stage's tiles, _form_scores) into the stage's tile instead of loaded, the chains waiting for it on
an mbarrier a stage before their output's product: with one chain by a scorer warpgroup of its own
(SCORER_REGS registers; the chain keeps 256), with two by the second chain for both (at
CHAIN_REGS_QK registers). GATES (KDA's bounded gate, gluon/chunk_delta.gates_in_scan; one chain):
the key, query and kd tiles are a ring of SLOTS slots the loader fills with the raw q, k (of the
q/k head) and the gate's input (of the value head) ahead of the stages, and K / 64 gater
warpgroups (_gater_t, GATER_REGS registers each) turn them into k 2^G, q 2^G and k 2^(G_last - G)
in place; the chain runs the GDN step's vector weights on them (rk on X^T's columns and the
update's rows, scale rq on Q^T's, the mask on V_new for A_qk), the norms being the prologue's.
Serves the delta rule (GDN, KDA), whole sequences (SEG 0) and segment replays (SEG 2), with h0 and
the final state in either layout; the chunk states (a ``[BV, K]`` pointer tile spills), the
segment summaries (SEG 1) and the plain rule stay on the two-chain and one-chain scans
(gluon/chunk_delta.regs_chains plans which).

Budget (K = V = 128, two stages, sm_90 compile; tests/backends/test_gluon_sm90.py): one chain 255
registers, no spill, 125 KB of shared memory (GDN; KDA's kd tiles: 155 KB); two chains at 224 +
232 registers, the loader's warpgroup at 48 (the final store's pointers spill outside the loops),
150 / 184 KB (GATES: 211 KB, the chain at 256 and two gaters at 120, 24 bytes of stack outside
the loops); one program per SM. Measured (docs/notes/gdn-prefill.md v26): 1x32k HV64 scan 945.5
-> 783.8 us on the H200 (one chain); on an H100 up to 11% off with two chains where the lanes
need more than one wave of 64-column programs.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from fastla.backends.gluon.chunk_delta_dual_sm90 import _load_stage
from fastla.backends.gluon.chunk_delta_sm90 import BK, BT, _inv_norms, _program
from fastla.backends.gluon.chunk_prepare_kda_sm90 import _add, _rcp_approx
from fastla.backends.gluon.chunk_scores_sm90 import LOG2E
from fastla.backends.triton.chunk_prepare import _activate_beta

BV_REGS = gl.constexpr(64)      # value columns a chain: the M side of the transposed products
LOADER_REGS = 48        # registers per thread of the loader warp (setmaxnreg)
CHAIN_REGS = 232        # of the second chain with CHAINS = 2 (the first gets the rest)
CHAIN_REGS_QK = 240     # the same with QK: the second chain forms the scores (232: 7 spill slots in its loop)
SCORER_REGS = gl.constexpr(128)     # of the scorer warpgroup (QK, one chain)
SLOTS = gl.constexpr(3)    # GATES: the key, query and kd tiles' ring (the rest of a stage keeps STAGES)
GATER_REGS = gl.constexpr(120)      # of each gater warpgroup (GATES, one chain, K / 64 of them; the chain keeps 256)
N_VEC = gl.constexpr(4)    # per-token vectors a stage: rk e^G, beta, rk e^(G_last - G), scale rq e^G (GDN)
N_VEC_QK = gl.constexpr(6)     # and with the scores formed in the chains: their rows' and columns' exponents


@gluon.jit
def _load_raw(k_desc, q_desc, g_desc, k_s, q_s, g_s, raw_loaded, raw_freed, i, bos, c_begin, i_h, i_hv,
              K: gl.constexpr):
    """GATES: chunk i's raw keys and queries (head i_h) and the gate's input (value head i_hv) by
    TMA into slot i % SLOTS of the key, query and kd tiles, once the chain has freed it (chunk
    i - SLOTS); the gaters turn them into kg, qg and kd in place."""
    NK: gl.constexpr = K // BK
    slot = (i % SLOTS).to(gl.int32)
    mbarrier.wait(raw_freed.index(slot), (((i // SLOTS) & 1) ^ 1).to(gl.int32))
    t0 = (bos + (c_begin + i) * BT).to(gl.int32)
    bar = raw_loaded.index(slot)
    mbarrier.expect(bar, 3 * NK * BT * BK * 2)
    for j in gl.static_range(NK):
        tma.async_copy_global_to_shared(k_desc, [t0, i_h * K + j * BK], bar, k_s.index(slot * NK + j))
        tma.async_copy_global_to_shared(q_desc, [t0, i_h * K + j * BK], bar, q_s.index(slot * NK + j))
        tma.async_copy_global_to_shared(g_desc, [t0, i_hv * K + j * BK], bar, g_s.index(slot * NK + j))


@gluon.jit
def _loader_t(k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s,
              loaded, freed, raw_loaded, raw_freed, beta, rq, rk, gcum, decay, bos, eos, c_begin, n_chunks,
              first_chunk, i_h, i_hv, i_v, scale, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
              V: gl.constexpr, L2NORM: gl.constexpr, BETA: gl.constexpr, SEG: gl.constexpr, STAGES: gl.constexpr,
              GK: gl.constexpr, CHAINS: gl.constexpr, QK: gl.constexpr, GATES: gl.constexpr,
              BETA_IN_P: gl.constexpr):
    """Each chunk's tiles by TMA (QK: no A_qk tile), then its per-token vectors into the stage's ``vec_s`` rows
    (zero past the sequence's end): the keys' weight in Y, rk e^G; beta (activated); the update's
    row weights rk e^(G_last - G); the output's scale rq e^G. GK (KDA: the gates are in the
    prologue's tiles): beta, and the rows' mask in the third row; the chunk's decays e^G_last
    [K] into ``dec_s``. QK (the scores formed in the chains, GDN): also the scores' exponents
    G log2 e + log2(scale rq) and G log2 e - log2 rk (_form_scores). GATES: the raw keys, queries
    and gate of each chunk into their own ring of SLOTS first (_load_raw), the stage the rest; the
    vectors rk, beta, rk (the update's rows, 0 past the end), scale rq and the rows' mask.
    The chains share the vectors (one value head); each has its value tile. The stage's ``loaded``
    barrier completes on the TMA bytes and this warp's arrival after its stores."""
    NV: gl.constexpr = N_VEC_QK if QK or GATES else N_VEC
    vec: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    r = gl.arange(0, BT, layout=vec)
    o_k = gl.arange(0, K, layout=gl.BlockedLayout([K // 32], [32], [1], [0]))
    for i in range(0, n_chunks):
        if GATES:               # the raw q, k and gate of chunk i into its slot, once the chain has read chunk i - SLOTS
            _load_raw(k_desc, q_desc, kd_desc, k_s, q_s, kd_s, raw_loaded, raw_freed, i, bos, c_begin, i_h, i_hv, K)
        stage = _load_stage(k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, loaded,
                            freed, i, bos, c_begin, i_h, i_hv, i_v, K, V, BV_REGS * CHAINS, STAGES, GK, SEG, True,
                            CHAINS, not QK, not GATES)
        t0 = bos + (c_begin + i) * BT
        m_t = r < eos - t0
        row = (t0 + r) * HV + i_hv
        if not BETA_IN_P:       # (folded: the inverse kernel wrote P diag(beta))
            b_beta = _activate_beta(gl.load(beta + row, mask=m_t, other=0.0), m_t, BETA)
        if GATES:               # the rows' norms as the chain's column weights (the gated tiles have none)
            b_rk, b_rq = _inv_norms(rq, rk, t0, r, m_t, i_h, H, L2NORM)
            vec_s.index(stage * NV).store(b_rk)
            if not BETA_IN_P:
                vec_s.index(stage * NV + 1).store(b_beta)
            vec_s.index(stage * NV + 2).store(b_rk)
            vec_s.index(stage * NV + 3).store(scale * b_rq)
            vec_s.index(stage * NV + 4).store(gl.where(m_t, 1.0, 0.0))
            dec_s.index(stage).store(gl.load(decay + ((first_chunk + c_begin + i) * HV + i_hv) * K + o_k))
        elif GK:
            vec_s.index(stage * NV + 1).store(b_beta)
            vec_s.index(stage * NV + 2).store(gl.where(m_t, 1.0, 0.0))
            dec_s.index(stage).store(gl.load(decay + ((first_chunk + c_begin + i) * HV + i_hv) * K + o_k))
        else:
            b_G = gl.load(gcum + row, mask=m_t, other=0.0)
            b_Gl = gl.load(gcum + (gl.minimum(eos, t0 + BT) - 1) * HV + i_hv)
            b_rk, b_rq = _inv_norms(rq, rk, t0, r, m_t, i_h, H, L2NORM)
            b_eg = gl.exp(b_G)
            vec_s.index(stage * NV).store(b_rk * b_eg)
            if not BETA_IN_P:
                vec_s.index(stage * NV + 1).store(b_beta)
            vec_s.index(stage * NV + 2).store(gl.where(m_t, b_rk * gl.exp(b_Gl - b_G), 0.0))
            vec_s.index(stage * NV + 3).store(scale * b_rq * b_eg)
            if QK:
                vec_s.index(stage * NV + 4).store(b_G * LOG2E + gl.log2(scale * b_rq))
                vec_s.index(stage * NV + 5).store(b_G * LOG2E - gl.log2(b_rk))
        gl.thread_barrier()
        mbarrier.arrive(loaded.index(stage), count=1)


@gluon.jit
def _initial_state_t(h0, seg_state, i_n, i_s, i_hv, o_v, o_k, p_state, accs: gl.constexpr, HV: gl.constexpr,
                     K: gl.constexpr, V: gl.constexpr, HAS_H0: gl.constexpr, SEG: gl.constexpr):
    """The state S^T [BV, K] fp32 a program starts from: a segment replay's recovered state
    (``[K, V]``), h0 (at ``p_state``: its SK, SV strides), or zeros."""
    if SEG == 2:
        S = gl.load(seg_state + (i_s * HV + i_hv) * K * V + o_k[None, :] * V + o_v[:, None])
    elif HAS_H0:
        S = gl.load(h0 + (i_n * HV + i_hv) * K * V + p_state).to(gl.float32)
    else:
        S = gl.zeros([BV_REGS, K], gl.float32, accs)
    return S


@gluon.jit
def _form_scores(sc, a_t, vec_s, vb, acc: gl.constexpr):
    """The causal scores A_qk = lower(scale rq_i rk_j (q_i . k_j) e^(G_i - G_j)) from Q K^T
    ``sc`` [BT (i), BT (j)] into the stage's tile ``a_t`` (bf16), fenced for wgmma and behind the
    partition's barrier. The row and column weights ride in the exponent: (q_i . k_j) 2^(u_i - w_j) with
    u = G log2 e + log2(scale rq), w = G log2 e - log2 rk (the loader's rows), one exponential
    and one product an entry; the mask is 2^-inf = 0, and so are the rows and columns past the
    sequence's end (rq = rk = 0 there: u = -inf, w = +inf)."""
    rows: gl.constexpr = gl.SliceLayout(1, acc)
    cols: gl.constexpr = gl.SliceLayout(0, acc)
    causal = gl.arange(0, BT, layout=rows)[:, None] >= gl.arange(0, BT, layout=cols)[None, :]
    d = vec_s.index(vb + 4).load(rows)[:, None] - vec_s.index(vb + 5).load(cols)[None, :]
    a_t.store((sc * gl.exp2(gl.where(causal, d, float("-inf")))).to(gl.bfloat16))     # 0 above the diagonal
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _scorer_t(k_s, q_s, a_s, vec_s, loaded, freed, scored, n_chunks, K: gl.constexpr, STAGES: gl.constexpr):
    """QK with one chain: a warpgroup of its own forms each chunk's scores (Q K^T by wgmma from the
    stage's tiles, then _form_scores into the stage's tile) and arrives on the stage's ``scored``,
    then on ``freed`` (its reads of the tiles are done), off the chain's critical path."""
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    kk_s = k_s._reinterpret(gl.bfloat16, [STAGES, BT, K], k_s.layout)
    qq_s = q_s._reinterpret(gl.bfloat16, [STAGES, BT, K], q_s.layout)
    for i in range(0, n_chunks):
        stage = (i % STAGES).to(gl.int32)
        mbarrier.wait(loaded.index(stage), ((i // STAGES) & 1).to(gl.int32))
        sc = warpgroup_mma(qq_s.index(stage), kk_s.index(stage).permute((1, 0)),
                           gl.zeros([BT, BT], gl.float32, acc), use_acc=False)
        _form_scores(sc, a_s.index(stage), vec_s, stage * N_VEC_QK, acc)
        mbarrier.arrive(scored.index(stage), count=1)
        mbarrier.arrive(freed.index(stage), count=1)


@gluon.jit
def _gater_t(W: gl.constexpr, k_s, q_s, kd_s, sums_s, raw_loaded, gated, A_log, dt_bias, lower_bound, bos, eos,
             c_begin, n_chunks, i_hv, K: gl.constexpr, HAS_A: gl.constexpr, HAS_BIAS: gl.constexpr,
             PACKED: gl.constexpr, WHOLE: gl.constexpr):
    """GATES (KDA's bounded gate, gluon/chunk_delta.gates_in_scan): gater W, a warpgroup of its
    own, forms each chunk's kg = k 2^G, qg = q 2^G and kd = k 2^(G_last - G) on channels 64 W ..
    64 W + 63 (one of the K / 64 gaters, one [64, 64] box each) from the raw tiles of the ring's
    slot (q and k of the q/k head, the gate's input of the value head in the kd tiles), in place,
    and arrives on the slot's ``gated``; the chain waits there. The rows' norms and the scale are
    not applied here: the chain takes them as column weights (the loader's vectors, from the
    norms the prologue wrote). In [4, 16, 64] tiles (warp = 16-row block, lane = two channels, a
    block's 16 rows in one thread, as the prologue's slices): r = sigmoid(a (g + dt_bias)) (0
    past the sequence's end) on one FFMA, two MUFU and an add; its cumsum in-thread within a
    block, the four block sums through ``sums_s``; G = lower_bound log2 e cumsum(r) <= 0, so every
    factor is at most 1 and nothing overflows. The prologue's decays e^G_last come by the loader.
    PACKED (gluon/chunk_delta.GATER_PACKED): the three products on bf16 pairs, the factors 2^G and
    2^(G_last - G) rounded to bf16 first (one rounding more an element). WHOLE
    (gluon/chunk_delta.WHOLE_CHUNK_BRANCHES): the rows' mask behind a branch that whole chunks
    skip (~97 of the loop's ~620 instructions: per-row compares of 64-bit bounds, their predicates
    and the selects)."""
    L3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16, 2], threads_per_warp=[1, 1, 32],
                                        warps_per_cta=[4, 1, 1], order=[2, 1, 0])
    L_bc: gl.constexpr = gl.SliceLayout(1, L3)                              # [4, 64] (block, channel)
    L4: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4, 2], threads_per_warp=[1, 1, 32],
                                        warps_per_cta=[4, 1, 1], order=[2, 1, 0])   # [1, 4, 64]: every block's sums
    box: gl.constexpr = gl.BlockedLayout([16, 2], [1, 32], [4, 1], [0, 1])  # a [64, 64] box as the [4, 16, 64] tiles
    NK: gl.constexpr = K // BK
    ib3 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    ir3 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    t = ib3 * 16 + ir3                                                      # [4, 16, 1] chunk rows
    o_c = gl.arange(0, BK, layout=gl.SliceLayout(0, L_bc))[None, None, :]  # [1, 1, 64]
    ib4 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L4)))[:, None, None]
    ic4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L4)))[None, :, None]
    if HAS_A:
        c = -LOG2E * gl.exp(gl.load(A_log + i_hv).to(gl.float32))      # the sigmoid's exponent: c (g + dt_bias)
    else:
        c = -LOG2E
    c_dt = gl.zeros([1, 1, BK], gl.float32, L3)
    if HAS_BIAS:
        c_dt = c * gl.load(dt_bias + i_hv * K + W * BK + o_c).to(gl.float32)
    lb = LOG2E * lower_bound                                                # log2 decay = lb r
    for i in range(0, n_chunks):
        slot = (i % SLOTS).to(gl.int32)
        mbarrier.wait(raw_loaded.index(slot), ((i // SLOTS) & 1).to(gl.int32))
        n_left = eos - (bos + (c_begin + i) * BT)                           # the chunk's rows in the sequence
        b = slot * NK + W
        x = gl.convert_layout(gl.reshape(kd_s.index(b).load(box), [4, 16, BK]), L3).to(gl.float32)
        x = _rcp_approx(1.0 + gl.exp2(x * c + c_dt))
        if WHOLE:
            if n_left < BT:     # a sequence's partial last chunk: no decay past its end
                x = gl.where(t < n_left, x, 0.0)
        else:
            x = gl.where(t < n_left, x, 0.0)
        s = gl.sum(x, 1)                                                    # [4, 64] block sums
        gl.thread_barrier()                                                 # (the last chunk's sums read)
        sums_s.store(s)
        ends = gl.associative_scan(gl.expand_dims(sums_s.load(gl.SliceLayout(0, L4)), 0), 1, _add)
        start = lb * (gl.convert_layout(gl.sum(gl.where(ic4 == ib4, ends, 0.0), 1), L_bc) - s)   # [4, 64] c_(b-1)
        last = lb * gl.convert_layout(gl.sum(gl.where(ic4 == 3, ends, 0.0), 1), L_bc)           # [1, 64] G_last
        G = lb * gl.associative_scan(x, 1, _add) + gl.expand_dims(start, 1)  # [4, 16, 64] G <= 0
        if PACKED:              # the factors rounded to bf16, the products on bf16 pairs (HMUL2)
            e_kd = gl.exp2(gl.expand_dims(last, 1) - G).to(gl.bfloat16)
            e = gl.exp2(G).to(gl.bfloat16)
            kb = gl.convert_layout(gl.reshape(k_s.index(b).load(box), [4, 16, BK]), L3)
        else:
            kb = gl.convert_layout(gl.reshape(k_s.index(b).load(box), [4, 16, BK]), L3).to(gl.float32)
            e_kd = gl.exp2(gl.expand_dims(last, 1) - G)
        kd_s.index(b).store(gl.convert_layout(gl.reshape((kb * e_kd).to(gl.bfloat16), [64, BK]), box))
        if not PACKED:
            e = gl.exp2(G)
        k_s.index(b).store(gl.convert_layout(gl.reshape((kb * e).to(gl.bfloat16), [64, BK]), box))
        qb = gl.convert_layout(gl.reshape(q_s.index(b).load(box), [4, 16, BK]), L3)
        if not PACKED:
            qb = qb.to(gl.float32)
        q_s.index(b).store(gl.convert_layout(gl.reshape((qb * e).to(gl.bfloat16), [64, BK]), box))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(gated.index(slot), count=1)


@gluon.jit
def _chunk_step_t(k_t, q_t, kd_t, v_t, p_t, a_t, vec_s, vb, dec_t, S, b_egl, scored, phase, acc: gl.constexpr,
                  accs: gl.constexpr, GK: gl.constexpr, QK: gl.constexpr, FORM: gl.constexpr,
                  GATES: gl.constexpr = False, BETA_IN_P: gl.constexpr = False):
    """One chunk's transposed products, its tiles landed (keys and queries ``[BT, K]``, values, P
    and A_qk, the per-token vectors at vec_s rows vb ..). Returns the new state S^T [BV, K] and
    the output O^T [BV, BT] (fp32). Each product is one wgmma op over its whole K: an accumulator
    chained from one op into the next makes ptxas wait for the first (C7517). GK (KDA): the
    keys and queries are the gated kg and qg, the update reads kd and the decays ``dec_t`` [K]:
    Y^T = (v^T - S^T kg^T) diag(beta), S^T = S^T diag(e^G_last) + V_new^T diag(mask) kd,
    O^T = S^T qg^T + V_new^T diag(mask) A_qk^T. QK (GDN): A_qk formed into the stage's tile ``a_t``
    from Q K^T, a product issued first and formed while X^T and Q^T run, by the chain that FORMs
    it; with two chains the second forms it and arrives on ``scored``, the first waits
    there (``phase``) before its output's product; with one, the scorer warpgroup forms it and
    the chain waits there. The tile is rewritten two chunks later, after the loader refilled the
    stage, which waits for every partition's ``freed``. GATES (the gaters' kg, qg and kd carry no
    norms): X^T's columns weighted by rk, the update's rows by rk and the output's Q^T columns by
    scale rq, as GDN's; V_new masked by row for A_qk."""
    cols: gl.constexpr = gl.SliceLayout(0, acc)
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    dot_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=accs, k_width=2)
    zero = gl.zeros([BV_REGS, BT], gl.float32, acc)                 # (made here: not held across the loop)
    if FORM:                                                        # Q K^T [BT, BT]
        sc = warpgroup_mma(q_t, k_t.permute((1, 0)), zero, use_acc=False, is_async=True)
    # X^T = S^T k^T and Q^T = S^T q^T (wait for X^T only)
    s_a = gl.convert_layout(S.to(gl.bfloat16), dot_a)
    x = warpgroup_mma(s_a, k_t.permute((1, 0)), zero, use_acc=False, is_async=True)
    qs = warpgroup_mma(s_a, q_t.permute((1, 0)), zero, use_acc=False, is_async=True)
    if FORM:
        sc = warpgroup_mma_wait(num_outstanding=2, deps=(sc,))
        _form_scores(sc, a_t, vec_s, vb, acc)
        mbarrier.arrive(scored, count=1)
    x = warpgroup_mma_wait(num_outstanding=1, deps=(x,))
    # Y^T = (v^T - X^T diag(rk e^G)) diag(beta);  V_new^T = Y^T P^T
    b_v = v_t.permute((1, 0)).load(acc).to(gl.float32)                     # v^T [BV, BT]
    if GK and not GATES:
        b_y = (b_v - x) * vec_s.index(vb + 1).load(cols)[None, :]
    elif BETA_IN_P:                                                 # (P diag(beta): beta is in V_new's product)
        b_y = b_v - x * vec_s.index(vb).load(cols)[None, :]
    else:
        b_y = (b_v - x * vec_s.index(vb).load(cols)[None, :]) * vec_s.index(vb + 1).load(cols)[None, :]
    y = gl.convert_layout(b_y.to(gl.bfloat16), dot_a)
    vn = warpgroup_mma(y, p_t.permute((1, 0)), zero, use_acc=False, is_async=True)
    vn, qs, s_a, y = warpgroup_mma_wait(num_outstanding=0, deps=(vn, qs, s_a, y))
    # S^T = e^G_last S^T + V_new^T diag(rk e^(G_last - G)) k;  O^T = Q^T diag(scale rq e^G) + V_new^T A_qk^T
    vm = vn * vec_s.index(vb + 2).load(cols)[None, :]          # GDN: rows weighted; GK: rows masked
    vd = gl.convert_layout(vm.to(gl.bfloat16), dot_s)
    if GATES:
        S = warpgroup_mma(vd, kd_t, S * dec_t.load(gl.SliceLayout(0, accs))[None, :], is_async=True)
        va = gl.convert_layout((vn * vec_s.index(vb + 4).load(cols)[None, :]).to(gl.bfloat16), dot_a)
        out = warpgroup_mma(va, a_t.permute((1, 0)), qs * vec_s.index(vb + 3).load(cols)[None, :], is_async=True)
    elif GK:
        S = warpgroup_mma(vd, kd_t, S * dec_t.load(gl.SliceLayout(0, accs))[None, :], is_async=True)
        va = gl.convert_layout(vm.to(gl.bfloat16), dot_a)
        out = warpgroup_mma(va, a_t.permute((1, 0)), qs, is_async=True)
    else:
        S = warpgroup_mma(vd, k_t, S * b_egl, is_async=True)
        va = gl.convert_layout(vn.to(gl.bfloat16), dot_a)
        if QK and not FORM:
            mbarrier.wait(scored, phase)
        out = warpgroup_mma(va, a_t.permute((1, 0)), qs * vec_s.index(vb + 3).load(cols)[None, :], is_async=True)
    S, out, vd, va = warpgroup_mma_wait(num_outstanding=0, deps=(S, out, vd, va))
    return S, out


@gluon.jit
def _store_output_t(out, o_desc, o_s, o, t0, eos, r, o_v, i_hv, i_v, n_rows, HV: gl.constexpr, V: gl.constexpr,
                    BRANCH: gl.constexpr):
    """A chunk's output O^T [BV, BT]: a whole chunk transposed into the output tile and sent by TMA
    (the previous chunk's store has left the tile); a sequence's partial last chunk by masked
    stores, its tile sent past the last row (TMA writes nothing out of bounds). BRANCH: the masked
    stores behind a branch that whole chunks skip (~87 instructions a step fewer); without it
    they issue predicated off (the second chain at CHAIN_REGS_QK, which the branch makes spill in
    its loop)."""
    whole = eos - t0 >= BT
    tma.store_wait(0)
    gl.thread_barrier()
    o_s.permute((1, 0)).store(out.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [gl.where(whole, t0, n_rows).to(gl.int32), i_hv * V + i_v * BV_REGS], o_s)
    if BRANCH:
        if not whole:
            o_ptr = o + ((t0 + r) * HV + i_hv)[None, :] * V + o_v[:, None]
            gl.store(o_ptr, out.to(o.dtype.element_ty), mask=(r < eos - t0)[None, :])
    else:
        o_ptr = o + ((t0 + r) * HV + i_hv)[None, :] * V + o_v[:, None]
        gl.store(o_ptr, out.to(o.dtype.element_ty), mask=(r < eos - t0)[None, :] & (eos - t0 < BT))


@gluon.jit
def _chain_t(CH: gl.constexpr, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s, o_s, loaded, freed, scored, raw_freed, o_desc,
             gcum, o, h0, ht, seg_state, bos, eos, c_begin, n_chunks, is_last, i_n, i_s, i_hv, i_v, n_rows, HV: gl.constexpr,
             K: gl.constexpr, V: gl.constexpr, SK: gl.constexpr, SV: gl.constexpr, HAS_H0: gl.constexpr,
             STORE_FINAL: gl.constexpr, SEG: gl.constexpr, STAGES: gl.constexpr, GK: gl.constexpr,
             CHAINS: gl.constexpr, QK: gl.constexpr, GATES: gl.constexpr, WHOLE: gl.constexpr,
             BETA_IN_P: gl.constexpr):
    """Chain CH: the 64 columns of value tile CHAINS i_v + CH, chunk by chunk (one warpgroup); GDN's
    e^G_last is the one value it loads itself (a chunk ahead). GATES: the key, query and kd tiles
    are slot i % SLOTS of their ring, gated by the gaters (``scored`` is their barrier) and waited
    for before the step; the chain frees the slot (``raw_freed``) with the stage."""
    i_v = i_v * CHAINS + CH
    NV: gl.constexpr = N_VEC_QK if QK or GATES else N_VEC
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    accs: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    r = gl.arange(0, BT, layout=gl.SliceLayout(0, acc))                   # chunk rows (tokens): columns here
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, accs))                 # key columns of the state
    o_v = i_v * BV_REGS + gl.arange(0, BV_REGS, layout=gl.SliceLayout(1, acc))      # value rows
    o_vs = i_v * BV_REGS + gl.arange(0, BV_REGS, layout=gl.SliceLayout(1, accs))
    p_state = o_vs[:, None] * SV + o_k[None, :] * SK                      # [BV, K] in one head's state
    # the stages' key and query tiles as [BT, K] (the loader's [BT, 64] boxes lie side by side:
    # a [64, 128] tile of this swizzle is its two 64-column halves, 8 KB apart, as TMA splits it)
    QS: gl.constexpr = SLOTS if GATES else STAGES
    kk_s = k_s._reinterpret(gl.bfloat16, [QS, BT, K], k_s.layout)
    qq_s = q_s._reinterpret(gl.bfloat16, [QS, BT, K], q_s.layout)
    kkd_s = kd_s._reinterpret(gl.bfloat16, [QS, BT, K], kd_s.layout)

    S = _initial_state_t(h0, seg_state, i_n, i_s, i_hv, o_vs, o_k, p_state, accs, HV, K, V, HAS_H0, SEG)
    t_last = gl.minimum(eos, bos + c_begin * BT + BT) - 1
    n_Gl = 0.0
    if not GK:
        n_Gl = gl.load(gcum + t_last * HV + i_hv, mask=n_chunks > 0, other=0.0)
    for i in range(0, n_chunks):
        c = c_begin + i
        stage = (i % STAGES).to(gl.int32)
        t0 = bos + c * BT
        b_egl = gl.exp(n_Gl)
        if not GK:
            n_Gl = gl.load(gcum + (gl.minimum(eos, t0 + 2 * BT) - 1) * HV + i_hv, mask=i + 1 < n_chunks, other=0.0)

        slot = (i % QS).to(gl.int32)
        mbarrier.wait(loaded.index(stage), ((i // STAGES) & 1).to(gl.int32))
        if GATES:
            mbarrier.wait(scored.index(slot), ((i // QS) & 1).to(gl.int32))
        S, out = _chunk_step_t(kk_s.index(slot), qq_s.index(slot), kkd_s.index(slot), v_s.index(stage * CHAINS + CH),
                               p_s.index(stage), a_s.index(stage), vec_s, stage * NV, dec_s.index(stage),
                               S, b_egl, scored.index(stage), ((i // STAGES) & 1).to(gl.int32), acc, accs, GK, QK,
                               QK and CHAINS == 2 and CH == 1, GATES, BETA_IN_P)
        mbarrier.arrive(freed.index(stage), count=1)                        # the loader may refill the stage
        if GATES:
            mbarrier.arrive(raw_freed.index(slot), count=1)
        _store_output_t(out, o_desc, o_s.index(CH), o, t0, eos, r, o_v, i_hv, i_v, n_rows, HV, V,
                        WHOLE and not (QK and CHAINS == 2))

    tma.store_wait(0)
    if STORE_FINAL:
        gl.store(ht + (i_n * HV + i_hv) * K * V + p_state, S.to(ht.dtype.element_ty), mask=(o_vs >= 0)[:, None] & is_last)


@gluon.jit(do_not_specialize=["T", "NT", "n_rows"])     # T = 1 would compile a variant of its own
def _scan_regs_sm90_kernel(
    k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, o_desc,
    beta, rq, rk, gcum, decay, o, h0, ht, cu_seqlens, chunk_start, segments, seg_state, A_log, dt_bias,
    T, NT, n_rows, scale, lower_bound,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
    SK: gl.constexpr, SV: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
    L2NORM: gl.constexpr, VARLEN: gl.constexpr, SEG: gl.constexpr, BETA: gl.constexpr,
    STAGES: gl.constexpr, GK: gl.constexpr, CHAINS: gl.constexpr, CHAIN_NREG: gl.constexpr,
    LOADER_NREG: gl.constexpr, QK: gl.constexpr, GATES: gl.constexpr, HAS_A: gl.constexpr,
    HAS_BIAS: gl.constexpr, PACKED: gl.constexpr, WHOLE: gl.constexpr, BETA_IN_P: gl.constexpr,
):
    NK: gl.constexpr = K // BK
    i_v, i_hv, i_h, i_s, i_n, bos, eos, first_chunk, c_begin, n_chunks, is_last = _program(
        segments, cu_seqlens, chunk_start, T, NT, H, HV, K, V, BV_REGS * CHAINS, VARLEN, SEG)

    tile: gl.constexpr = k_desc.layout
    QS: gl.constexpr = SLOTS if GATES else STAGES               # the key, query and kd tiles' ring
    k_s = gl.allocate_shared_memory(gl.bfloat16, [QS * NK, BT, BK], tile)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [QS * NK, BT, BK], tile)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], tile)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], tile)     # (QK: the last chain writes them)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CHAINS, BT, BV_REGS], v_desc.layout)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    vec_s = gl.allocate_shared_memory(gl.float32, [STAGES * (N_VEC_QK if QK or GATES else N_VEC), BT], plain)
    if GK:                                  # the gated keys' kd tiles and the chunks' decays
        kd_s = gl.allocate_shared_memory(gl.bfloat16, [QS * NK, BT, BK], tile)
        dec_s = gl.allocate_shared_memory(gl.float32, [STAGES, K], plain)
    else:
        kd_s = k_s
        dec_s = vec_s
    o_s = gl.allocate_shared_memory(gl.bfloat16, [CHAINS, BT, BV_REGS], o_desc.layout)
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    freed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    SCORER: gl.constexpr = QK and CHAINS == 1        # a warpgroup of its own forms the scores
    gl.static_assert(not GATES or (GK and CHAINS == 1 and not QK), "the gater serves KDA's one-chain scan")
    if QK or GATES:             # the stage's scores formed (by the scorer or chain 1), or a slot's gated tiles
        scored = gl.allocate_shared_memory(gl.int64, [QS, 1], bar)
    else:
        scored = freed
    if GATES:                   # the raw tiles' ring and the gaters' block sums
        raw_loaded = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], bar)
        raw_freed = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], bar)
        sums_s = gl.allocate_shared_memory(gl.float32, [4, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        sums1_s = gl.allocate_shared_memory(gl.float32, [4, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    else:
        raw_loaded = loaded
        raw_freed = freed
    for st in gl.static_range(STAGES):
        mbarrier.init(loaded.index(st), count=2)        # the TMA bytes' expect and the vectors' arrival
        mbarrier.init(freed.index(st), count=CHAINS + (1 if SCORER else 0))
        if QK:
            mbarrier.init(scored.index(st), count=1)
    if GATES:
        for sl in gl.static_range(SLOTS):
            mbarrier.init(scored.index(sl), count=NK)            # each gater's arrival
            mbarrier.init(raw_loaded.index(sl), count=1)         # the TMA bytes' expect
            mbarrier.init(raw_freed.index(sl), count=1)          # the chain's arrival
    fence_async_shared()

    i_hv32 = i_hv.to(gl.int32)
    i_h32 = i_hv32 if GK and not GATES else i_h.to(gl.int32)             # the column block of k, q
    if CHAINS == 2:
        gl.warp_specialize([
            (_chain_t, (0, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s, o_s, loaded, freed, scored, raw_freed, o_desc, gcum, o, h0,
                        ht, seg_state, bos, eos, c_begin, n_chunks, is_last, i_n, i_s, i_hv32, i_v, n_rows, HV, K, V, SK,
                        SV, HAS_H0, STORE_FINAL, SEG, STAGES, GK, CHAINS, QK, GATES, WHOLE, BETA_IN_P)),
            (_chain_t, (1, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s, o_s, loaded, freed, scored, raw_freed, o_desc, gcum, o, h0,
                        ht, seg_state, bos, eos, c_begin, n_chunks, is_last, i_n, i_s, i_hv32, i_v, n_rows, HV, K, V, SK,
                        SV, HAS_H0, STORE_FINAL, SEG, STAGES, GK, CHAINS, QK, GATES, WHOLE, BETA_IN_P)),
            (_loader_t, (k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s,
                         loaded, freed, raw_loaded, raw_freed, beta, rq, rk, gcum, decay, bos, eos, c_begin, n_chunks,
                         first_chunk, i_h32, i_hv32, i_v, scale, H, HV, K, V, L2NORM, BETA, SEG, STAGES, GK, CHAINS, QK,
                         GATES, BETA_IN_P)),
        ], [4, 1], [CHAIN_NREG, LOADER_NREG])
    elif GATES and NK == 2:
        gl.warp_specialize([
            (_chain_t, (0, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s, o_s, loaded, freed, scored, raw_freed, o_desc, gcum, o, h0,
                        ht, seg_state, bos, eos, c_begin, n_chunks, is_last, i_n, i_s, i_hv32, i_v, n_rows, HV, K, V, SK,
                        SV, HAS_H0, STORE_FINAL, SEG, STAGES, GK, CHAINS, QK, GATES, WHOLE, BETA_IN_P)),
            (_gater_t, (0, k_s, q_s, kd_s, sums_s, raw_loaded, scored, A_log, dt_bias, lower_bound, bos, eos,
                        c_begin, n_chunks, i_hv32, K, HAS_A, HAS_BIAS, PACKED, WHOLE)),
            (_gater_t, (1, k_s, q_s, kd_s, sums1_s, raw_loaded, scored, A_log, dt_bias, lower_bound, bos, eos,
                        c_begin, n_chunks, i_hv32, K, HAS_A, HAS_BIAS, PACKED, WHOLE)),
            (_loader_t, (k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s,
                         loaded, freed, raw_loaded, raw_freed, beta, rq, rk, gcum, decay, bos, eos, c_begin, n_chunks,
                         first_chunk, i_h32, i_hv32, i_v, scale, H, HV, K, V, L2NORM, BETA, SEG, STAGES, GK, CHAINS, QK,
                         GATES, BETA_IN_P)),
        ], [4, 4, 1], [GATER_REGS, GATER_REGS, LOADER_NREG])
    elif GATES:
        gl.warp_specialize([
            (_chain_t, (0, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s, o_s, loaded, freed, scored, raw_freed, o_desc, gcum, o, h0,
                        ht, seg_state, bos, eos, c_begin, n_chunks, is_last, i_n, i_s, i_hv32, i_v, n_rows, HV, K, V, SK,
                        SV, HAS_H0, STORE_FINAL, SEG, STAGES, GK, CHAINS, QK, GATES, WHOLE, BETA_IN_P)),
            (_gater_t, (0, k_s, q_s, kd_s, sums_s, raw_loaded, scored, A_log, dt_bias, lower_bound, bos, eos,
                        c_begin, n_chunks, i_hv32, K, HAS_A, HAS_BIAS, PACKED, WHOLE)),
            (_loader_t, (k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s,
                         loaded, freed, raw_loaded, raw_freed, beta, rq, rk, gcum, decay, bos, eos, c_begin, n_chunks,
                         first_chunk, i_h32, i_hv32, i_v, scale, H, HV, K, V, L2NORM, BETA, SEG, STAGES, GK, CHAINS, QK,
                         GATES, BETA_IN_P)),
        ], [4, 1], [GATER_REGS, LOADER_NREG])
    elif SCORER:
        gl.warp_specialize([
            (_chain_t, (0, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s, o_s, loaded, freed, scored, raw_freed, o_desc, gcum, o, h0,
                        ht, seg_state, bos, eos, c_begin, n_chunks, is_last, i_n, i_s, i_hv32, i_v, n_rows, HV, K, V, SK,
                        SV, HAS_H0, STORE_FINAL, SEG, STAGES, GK, CHAINS, QK, GATES, WHOLE, BETA_IN_P)),
            (_scorer_t, (k_s, q_s, a_s, vec_s, loaded, freed, scored, n_chunks, K, STAGES)),
            (_loader_t, (k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s,
                         loaded, freed, raw_loaded, raw_freed, beta, rq, rk, gcum, decay, bos, eos, c_begin, n_chunks,
                         first_chunk, i_h32, i_hv32, i_v, scale, H, HV, K, V, L2NORM, BETA, SEG, STAGES, GK, CHAINS, QK,
                         GATES, BETA_IN_P)),
        ], [4, 1], [SCORER_REGS, LOADER_NREG])
    else:
        gl.warp_specialize([
            (_chain_t, (0, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s, o_s, loaded, freed, scored, raw_freed, o_desc, gcum, o, h0,
                        ht, seg_state, bos, eos, c_begin, n_chunks, is_last, i_n, i_s, i_hv32, i_v, n_rows, HV, K, V, SK,
                        SV, HAS_H0, STORE_FINAL, SEG, STAGES, GK, CHAINS, QK, GATES, WHOLE, BETA_IN_P)),
            (_loader_t, (k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, k_s, q_s, kd_s, v_s, p_s, a_s, vec_s, dec_s,
                         loaded, freed, raw_loaded, raw_freed, beta, rq, rk, gcum, decay, bos, eos, c_begin, n_chunks,
                         first_chunk, i_h32, i_hv32, i_v, scale, H, HV, K, V, L2NORM, BETA, SEG, STAGES, GK, CHAINS, QK,
                         GATES, BETA_IN_P)),
        ], [1], [LOADER_NREG])
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(loaded.index(st))
        mbarrier.invalidate(freed.index(st))
        if QK:
            mbarrier.invalidate(scored.index(st))
    if GATES:
        for sl in gl.static_range(SLOTS):
            mbarrier.invalidate(scored.index(sl))
            mbarrier.invalidate(raw_loaded.index(sl))
            mbarrier.invalidate(raw_freed.index(sl))
