"""Triton chunked forward of the gated delta rule (GDN), in two kernels.

Inputs as the public op takes them, contiguous: q, k ``[B, T, H, K]`` (GVA: value head ``j``
reads head ``j // (HV // H)``), v ``[B, T, HV, V]``, g / beta ``[B, T, HV]`` (raw when the gate
or the beta sigmoid is computed in the op); the l2norm of q and k, the GDN gate
``-exp(A_log) * softplus(g + dt_bias)`` and the beta sigmoid are applied inside the kernels.
A dense batch is handled as a packed one: ``cu = [0, T, 2T, ..]`` over the ``B * T`` tokens.

Kernel 1, ``_prepare_kernel``, grid ``(chunks, HV)``, one 64-token chunk of one value head:
    G = cumsum(g)                                                [BT]
    A = strict_lower(beta_i * (k_i . k_j) * exp(G_i - G_j))      [BT, BT]
    P = (I + A)^-1 by row-wise forward substitution (fp32)
    W = P (beta * exp(G) * k)   [BT, K],   U = P (beta * v)   [BT, V]
  writes W, U (bf16) and G (fp32).
Kernel 2, ``_scan_kernel``, grid ``(N * HV, V / BV)``, one sequence's chunks in order with
the state slab ``S [K, BV]`` (float32) in registers:
    V_new = U - W S
    O = scale * (exp(G) * (q S) + causal(q k^T * exp(G_i - G_j)) V_new)
    S = exp(G_last) S + k^T (exp(G_last - G) * V_new)
  writes O, the chunk-start states when asked, and the final state.

Precision as FLA's chunk kernels: bf16 operands with fp32 accumulation for the products with
the state and the scores (bf16 inputs; fp32 operands otherwise); fp32 forward substitution
for the inverse, tf32 for W/U. Budget (K = V = 128, BT = 64, sm_90,
checked in tests/backends/test_triton_sm90.py): kernel 1 at 8 warps 173 registers, 48 KB
shared, no spill; kernel 2 (BV = 32, 8 warps, one stage) 255 registers, a ~220-byte spill,
60 KB shared. Opt-in until measured on the H200 (docs/notes/gdn-prefill.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastla.backends.triton import interpreting
from fastla.backends.triton.recurrent import _softplus
from fastla.core.problem import Problem

BT = 64


@triton.jit
def _prepare_kernel(
    k, v, g, beta, A_log, dt_bias, w, u, gcum, cu_seqlens, chunk_index,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, DOT: tl.constexpr,
    L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)                                                 # GVA: the q/k head
    i_n = tl.load(chunk_index + 2 * i_c).to(tl.int64)
    c = tl.load(chunk_index + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + c * BT                                                       # first token (int64)
    r = tl.arange(0, BT)
    m_t = r < eos - t0
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVF)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    # 64-bit chunk bases, 32-bit offsets inside the tile
    off_k = r[:, None] * (H * K) + o_k[None, :]                             # [BT, BK] in q/k
    off_v = r[:, None] * (HV * V) + o_v[None, :]                            # [BT, BVF] in v, w, u
    off_w = r[:, None] * (HV * K) + o_k[None, :]                            # [BT, BK] in w
    base = t0 * HV + i_hv

    b_k = tl.load(k + (t0 * H + i_h) * K + off_k, mask=m_tk, other=0.0).to(tl.float32)       # [BT, BK]
    if L2NORM:
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    b_v = tl.load(v + base * V + off_v, mask=m_tv, other=0.0).to(tl.float32)                 # [BT, BVF]
    b_g = tl.load(g + base + r * HV, mask=m_t, other=0.0).to(tl.float32)                     # [BT]
    if GATE:
        if HAS_BIAS:
            b_g = b_g + tl.load(dt_bias + i_hv).to(tl.float32)
        b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * _softplus(b_g)
        b_g = tl.where(m_t, b_g, 0.0)
    b_beta = tl.load(beta + base + r * HV, mask=m_t, other=0.0).to(tl.float32)               # [BT]
    if BETA >= 2:
        b_beta = tl.where(m_t, tl.sigmoid(b_beta), 0.0)
    if BETA == 3:
        b_beta = 2.0 * b_beta
    b_G = tl.cumsum(b_g, 0)                                                                    # [BT]
    b_kd = b_k.to(DOT)

    lower = r[:, None] > r[None, :]
    decay = tl.exp(tl.where(lower, b_G[:, None] - b_G[None, :], 0.0))                          # <= 1
    b_kk = tl.dot(b_kd, tl.trans(b_kd))                                                        # [BT, BT] fp32 acc
    b_A = tl.where(lower, b_beta[:, None] * b_kk * decay, 0.0)

    # P = (I + A)^-1 by forward substitution, one row at a time in fp32 (stable for the unit
    # lower-triangular system; the product form (I - A)(I + A^2)... cancels catastrophically
    # when keys are correlated):  P_i = e_i - sum_{j<i} A_ij P_j
    rows = r[:, None]
    b_P = tl.where(rows == r[None, :], 1.0, 0.0)                                                # [BT, BT]
    for i in range(1, BT):
        a_i = tl.sum(tl.where(rows == i, b_A, 0.0), 0)                                          # A[i, :] [BT]
        p_i = -tl.sum(a_i[:, None] * b_P, 0)                                                    # [BT]
        b_P = tl.where(rows == i, b_P + p_i[None, :], b_P)

    b_kb = b_k * (b_beta * tl.exp(b_G))[:, None]
    b_w = tl.dot(b_P, b_kb, input_precision="tf32")                                           # [BT, BK]
    b_u = tl.dot(b_P, b_v * b_beta[:, None], input_precision="tf32")                          # [BT, BVF]
    tl.store(w + base * K + off_w, b_w.to(w.dtype.element_ty), mask=m_tk)
    tl.store(u + base * V + off_v, b_u.to(u.dtype.element_ty), mask=m_tv)
    tl.store(gcum + base + r * HV, b_G, mask=m_t)


@triton.jit
def _scan_kernel(
    q, k, w, u, gcum, o, h0, ht, h_chunks, cu_seqlens, chunk_start,
    scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SK: tl.constexpr, SV: tl.constexpr, DOT: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_CHUNKS: tl.constexpr, L2NORM: tl.constexpr,
):
    i_nh = tl.program_id(0).to(tl.int64)                                    # axis 0: up to 2^31 - 1 programs
    i_v = tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_tile = o_k[:, None] * SK + o_v[None, :] * SV                          # [BK, BV] inside one head state
    state = i_hv * K * V

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_S = tl.load(h0 + i_n * HV * K * V + state + p_tile, mask=m_h, other=0.0).to(tl.float32)

    r = tl.arange(0, BT)
    causal = r[:, None] >= r[None, :]
    off_k = r[:, None] * (H * K) + o_k[None, :]                             # [BT, BK] in q/k, inside a chunk
    off_w = r[:, None] * (HV * K) + o_k[None, :]                            # [BT, BK] in w
    off_v = r[:, None] * (HV * V) + o_v[None, :]                            # [BT, BV]
    first_chunk = tl.load(chunk_start + i_n).to(tl.int64)
    for c in range(0, tl.cdiv(eos - bos, BT)):
        if STORE_CHUNKS:
            tl.store(h_chunks + (first_chunk + c) * HV * K * V + state + p_tile,
                     b_S.to(h_chunks.dtype.element_ty), mask=m_h)
        t0 = bos + c * BT
        base = t0 * HV + i_hv                                               # int64 chunk base
        m_t = r < eos - t0
        if K == BK:
            m_tk = m_t[:, None]                                             # rows only: [BT, 1]
        else:
            m_tk = m_t[:, None] & m_k[None, :]
        if V % BV == 0:
            m_tv = m_t[:, None]
        else:
            m_tv = m_t[:, None] & m_v[None, :]
        base_qk = (t0 * H + i_h) * K
        b_q = tl.load(q + base_qk + off_k, mask=m_tk, other=0.0)                                  # [BT, BK]
        b_k = tl.load(k + base_qk + off_k, mask=m_tk, other=0.0)                                  # [BT, BK]
        if L2NORM:
            b_q = b_q.to(tl.float32)
            b_q = (b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None])
            b_k = b_k.to(tl.float32)
            b_k = (b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None])
        b_q = b_q.to(DOT)
        b_k = b_k.to(DOT)
        b_w = tl.load(w + base * K + off_w, mask=m_tk, other=0.0)                                 # [BT, BK]
        b_u = tl.load(u + base * V + off_v, mask=m_tv, other=0.0)                                 # [BT, BV]
        b_G = tl.load(gcum + base + r * HV, mask=m_t, other=0.0)                                  # [BT]
        last = tl.minimum(eos - bos - c * BT, BT) - 1
        b_Gl = tl.sum(tl.where(r == last, b_G, 0.0))                        # G at the chunk's last token

        b_S16 = b_S.to(DOT)
        b_vn = b_u.to(tl.float32) - tl.dot(b_w, b_S16)                                            # [BT, BV]
        b_qk = tl.dot(b_q, tl.trans(b_k))                                                         # [BT, BT]
        b_A = tl.where(causal, b_qk * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
        # row scalings move to the [BT, BV] side: (exp(G) * q) S = exp(G) * (q S), and
        # (exp(G_last - G) * k)^T V_new = k^T (exp(G_last - G) * V_new)
        b_o = tl.dot(b_q, b_S16) * tl.exp(b_G)[:, None]
        b_o = (b_o + tl.dot(b_A.to(DOT), b_vn.to(DOT))) * scale
        tl.store(o + base * V + off_v, b_o.to(o.dtype.element_ty), mask=m_tv)

        b_vd = b_vn * tl.where(m_t, tl.exp(b_Gl - b_G), 0.0)[:, None]
        b_S = b_S * tl.exp(b_Gl) + tl.dot(tl.trans(b_k), b_vd.to(DOT))

    if STORE_FINAL:
        tl.store(ht + i_n * HV * K * V + state + p_tile, b_S.to(ht.dtype.element_ty), mask=m_h)


def supports(p: Problem) -> str | None:
    from fastla.backends.triton import available
    from fastla.core.dispatch import requested_tier

    reason = available(p.device)
    if reason:
        return reason
    if requested_tier() != "triton":
        return "the Triton GDN forward is experimental until measured on the H200: opt in with FASTLA_BACKEND=triton"
    if p.chunk_size != BT:
        return f"chunk_size {p.chunk_size} (the Triton GDN forward uses {BT})"
    if p.K > 128 or p.V > 128:
        return "head dims above 128"
    if p.q.dtype == torch.float64:
        return "float64 inputs are served by the torch tier"
    if p.cu_seqlens is not None and p.cu_seqlens_host is None:
        return "needs the sequence offsets on the host (pass cu_seqlens_cpu)"
    if p.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "builds its chunk index on the host, which a CUDA graph capture cannot copy"
    tensors = [p.q, p.k, p.v, p.g, p.beta, p.initial_state, p.A_log, p.dt_bias]
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        return "inputs require grad: no Triton backward yet (the torch tier has autograd)"
    if not all(x.is_contiguous() for x in tensors if x is not None):
        return "non-contiguous inputs (the kernels read contiguous [B, T, H, D] tensors)"
    return None


def run(p: Problem):
    B, T, H, HV, K, V, N = p.B, p.T, p.H, p.HV, p.K, p.V, p.N
    dev = p.device
    cu_host = list(p.cu_seqlens_host) if p.cu_seqlens_host is not None else [b * T for b in range(B + 1)]
    counts = [-(-(e - s) // BT) for s, e in zip(cu_host[:-1], cu_host[1:])]
    starts = [sum(counts[:n]) for n in range(N)]
    pairs = [(n, c) for n in range(N) for c in range(counts[n])]
    cu = torch.tensor(cu_host, dtype=torch.int64, device=dev)
    chunk_index = torch.tensor(pairs or [(0, 0)], dtype=torch.int64, device=dev)
    chunk_start = torch.tensor(starts or [0], dtype=torch.int64, device=dev)

    # bf16 products for bf16 inputs (as FLA), fp32 operands otherwise and always in the CPU
    # interpreter, whose bf16 products are wrong (Triton 3.6)
    bf16 = p.q.dtype == torch.bfloat16 and not interpreting()
    op_dtype = torch.bfloat16 if bf16 else torch.float32
    dot = tl.bfloat16 if bf16 else tl.float32
    g = p.g if p.g is not None else p.q.new_zeros(B, T, HV, dtype=torch.float32)
    beta = p.beta if p.beta is not None else p.q.new_ones(B, T, HV, dtype=torch.float32)
    beta_mode = 1 if p.beta is None or not p.beta_sigmoid else (3 if p.allow_neg_eigval else 2)
    w = torch.empty(B, T, HV, K, dtype=op_dtype, device=dev)
    u = torch.empty(B, T, HV, V, dtype=op_dtype, device=dev)
    gcum = torch.empty(B, T, HV, dtype=torch.float32, device=dev)
    BK, BVF = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))   # tl.dot needs >= 16
    dummy = gcum
    if pairs:
        _prepare_kernel[(len(pairs), HV)](
            p.k, p.v, g, beta, p.A_log if p.A_log is not None else dummy,
            p.dt_bias if p.dt_bias is not None else dummy, w, u, gcum, cu, chunk_index,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BVF=BVF, DOT=dot,
            L2NORM=p.use_qk_l2norm, GATE=p.gate_in_op == "gdn", HAS_BIAS=p.dt_bias is not None, BETA=beta_mode,
            num_warps=8, num_stages=1,
        )

    o = torch.empty(B, T, HV, V, dtype=p.o_dtype, device=dev)
    state_shape = (HV, V, K) if p.state_v_first else (HV, K, V)
    ht = torch.empty(N, *state_shape, dtype=torch.float32, device=dev) if p.output_final_state else None
    total = sum(counts)
    h_chunks = torch.empty(total, *state_shape, dtype=p.k.dtype, device=dev) if p.return_intermediate_states else None
    BV = min(32, BVF)
    h0 = p.initial_state
    q, k = (p.q, p.k) if p.q.dtype == op_dtype or bf16 else (p.q.to(op_dtype), p.k.to(op_dtype))
    _scan_kernel[(N * HV, triton.cdiv(V, BV))](
        q, k, w, u, gcum, o, h0 if h0 is not None else o, ht if ht is not None else o,
        h_chunks if h_chunks is not None else o, cu, chunk_start, p.scale,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV,
        SK=1 if p.state_v_first else V, SV=K if p.state_v_first else 1, DOT=dot,
        HAS_H0=h0 is not None, STORE_FINAL=ht is not None, STORE_CHUNKS=h_chunks is not None,
        L2NORM=p.use_qk_l2norm, num_warps=8, num_stages=1,
    )
    if p.return_intermediate_states:
        h = h_chunks[None] if p.cu_seqlens_host is not None else h_chunks.view(B, total // max(B, 1), *state_shape)
        return o, ht, h
    return o, ht
