"""Hopper (sm_90) scores kernel of the GDN prologue: Gluon, the same outputs as the Triton scores
kernel (backends/triton/chunk_prepare.py, ``_scores_kernel``), which it replaces on the Gluon tier.

Per 64-token chunk and q/k head, after the inverse kernel has written G (``gcum``), with 1 / |x| as
rq, rk when the l2norm is in the op (else 1):
    scores = lower(scale rq_i rk_j (q_i . k_j) e^(G_i - G_j))     bf16  [B, T, HV, 64] (whole rows)
    rq, rk                                                          fp32  [B, T, H]     (l2norm only)
for each of the q/k head's HV / H value heads (their own G).

Grid ``(chunks, H)``, 4 warps (one warpgroup). The chunk's q and k tiles come by TMA ([64, 64]
boxes; rows past B * T zero-filled; rows of the next sequence only reach rows that are not
stored); Q K^T and, with the l2norm, the Gram diagonals' K K^T and Q Q^T by wgmma (bf16, fp32
accumulators [64, 64] in registers: warp w holds rows 16w .. 16w + 15); the norms from the
diagonals. Q K^T is scaled and masked to the lower triangle once; per value head the kernel loads G
once (L2) and moves it to the rows' and the columns' vectors of the accumulator layout, forms
e^(G_i - G_j) (the exponent masked to 0 above the diagonal) and stores the product in 16-byte runs
(through a layout conversion: from the accumulator layout each thread would write pairs of bf16).

Budget (K = 128): 32 KB of q / k tiles, 122 registers (96 of them the three accumulators during the
products, with the l2norm): four programs an SM, no spill. Traffic per token: q and k read once
per q/k head, 128 bytes of scores per value head. Measurements: docs/notes/gdn-prefill.md (v17).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from fastla.backends.triton.chunk_index import _chunk

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit(do_not_specialize=["T", "NT"])
def _gdn_scores_sm90_kernel(
    q_desc, k_desc, gcum, s_out, rq_out, rk_out, cu_seqlens, chunk_index, T, NT, scale,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, L2NORM: gl.constexpr, VARLEN: gl.constexpr,
):
    gl.static_assert(K % 64 == 0, "K in [64, 64] boxes")
    NK: gl.constexpr = K // 64
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    cols_l: gl.constexpr = gl.SliceLayout(0, acc_l)

    i_c = gl.program_id(0).to(gl.int64)
    i_h = gl.program_id(1)
    i_n, c_seq, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c_seq * 64                                                   # first token (int64)
    n_left = eos - t0                                                       # tokens of the chunk from t0, >= 1

    q_s = gl.allocate_shared_memory(gl.bfloat16, [NK, 64, 64], q_desc.layout)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [NK, 64, 64], k_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    mbarrier.expect(bar, 2 * NK * 64 * 64 * 2)
    row = t0.to(gl.int32)
    for kk in gl.static_range(NK):
        tma.async_copy_global_to_shared(q_desc, [row, i_h * K + kk * 64], bar, q_s.index(kk))
        tma.async_copy_global_to_shared(k_desc, [row, i_h * K + kk * 64], bar, k_s.index(kk))
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)

    r = gl.arange(0, 64, layout=rows_l)
    c = gl.arange(0, 64, layout=cols_l)
    valid_r = r < n_left
    causal = r[:, None] >= c[None, :]
    zero = gl.zeros([64, 64], gl.float32, acc_l)
    qk = zero
    if L2NORM:                                                              # with the Gram diagonals: the norms
        kk_acc = zero
        qq_acc = zero
        for kk in gl.static_range(NK):
            qk = warpgroup_mma(q_s.index(kk), k_s.index(kk).permute((1, 0)), qk, is_async=True)
            kk_acc = warpgroup_mma(k_s.index(kk), k_s.index(kk).permute((1, 0)), kk_acc, is_async=True)
            qq_acc = warpgroup_mma(q_s.index(kk), q_s.index(kk).permute((1, 0)), qq_acc, is_async=True)
        qk, kk_acc, qq_acc = warpgroup_mma_wait(num_outstanding=0, deps=(qk, kk_acc, qq_acc))
        diag = r[:, None] == c[None, :]
        rk = gl.rsqrt(gl.sum(gl.where(diag, kk_acc, 0.0), 1) + 1e-6)        # [64] rows
        rq = gl.rsqrt(gl.sum(gl.where(diag, qq_acc, 0.0), 1) + 1e-6)
        gl.store(rq_out + (t0 + r) * H + i_h, rq, mask=valid_r)
        gl.store(rk_out + (t0 + r) * H + i_h, rk, mask=valid_r)
        qk = gl.where(causal, qk * (scale * rq)[:, None] * gl.convert_layout(rk, cols_l)[None, :], 0.0)
    else:
        for kk in gl.static_range(NK):
            qk = warpgroup_mma(q_s.index(kk), k_s.index(kk).permute((1, 0)), qk, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        qk = gl.where(causal, qk * scale, 0.0)

    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])             # [64] token vectors
    out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # rows of 8 x 16 bytes
    o_t = gl.arange(0, 64, layout=vec_l)
    m_t = o_t < n_left
    r_o = gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))[:, None]
    c_o = gl.arange(0, 64, layout=gl.SliceLayout(0, out_l))[None, :]
    for j in range(HV // H):                                                # the q/k head's value heads
        i_hv = i_h * (HV // H) + j
        G = gl.load(gcum + (t0 + o_t) * HV + i_hv, mask=m_t, other=0.0) * LOG2E      # [64]
        g_r = gl.convert_layout(G, rows_l)
        g_c = gl.convert_layout(G, cols_l)
        e = gl.exp2(gl.where(causal, g_r[:, None] - g_c[None, :], 0.0))     # e^(G_i - G_j), 1 above the diagonal
        s = gl.convert_layout((qk * e).to(gl.bfloat16), out_l)
        gl.store(s_out + ((t0 + r_o) * HV + i_hv) * 64 + c_o, s, mask=r_o < n_left)


def launch(p, q, k, total: int, tables, gcum, scores, rq, rk, dot, config) -> None:
    """chunk_prepare.launch_scores's contract (``q``, ``k`` are p.q, p.k here: bf16; ``dot`` and
    ``config`` unused): the causal scores into ``scores`` ``[B, T, HV, 64]`` from G in ``gcum``,
    and with the l2norm 1 / |q|, 1 / |k| into ``rq``, ``rk`` ``[B, T, H]``."""
    from fastla.backends.gluon.chunk_delta import _tile_layout, tma_descriptor
    from fastla.backends.triton.launch import launcher

    def desc(x):                             # [B * T, H * K] in [64, 64] boxes (rows past B * T: zeros)
        return tma_descriptor(x, p.B * p.T, p.H * p.K, [64, 64], _tile_layout(64, 64))

    cu, chunk_index = tables
    varlen = cu is not None
    NT = -(-p.T // 64)
    d = gcum
    launcher(_gdn_scores_sm90_kernel, p.T, NT)[(total, p.H)](
        desc(q), desc(k), gcum, scores, rq if rq is not None else d, rk if rk is not None else d,
        cu if varlen else d, chunk_index if varlen else d, p.T, NT, p.scale,
        H=p.H, HV=p.HV, K=p.K, L2NORM=p.use_qk_l2norm, VARLEN=varlen, num_warps=4,
    )
