"""Triton chunked backward of the scalar-gate rules: the gated delta rule (GDN) and, with ``DELTA``
False, the plain rule (Simple GLA, Lightning: V_new = v, no beta nor A). Gradients of q, k, v, the
log decay g, beta and the initial state, from dO and dht.

Inputs are the activated ones (``chunk_training.py`` applies the l2norm, the gate and the beta
sigmoid in PyTorch, whose autograd takes their gradients): q, k ``[B, T, H, K]`` (GVA: value
head ``j`` reads head ``j // (HV // H)``), v, dO ``[B, T, HV, V]``, g (log decay) and beta
``[B, T, HV]`` float32, h0 and dht ``[N, HV, K, V]`` float32 (K-first). Varlen batches use the
forward's chunk tables (chunk_delta._varlen_index).

Per chunk (C = 64 tokens; G the in-chunk cumsum of g, Gamma_ij = e^(G_i - G_j) for i >= j, S the
state at the chunk's start, S' at its end), the forward (chunk_delta.py) is
    X = v - diag(e^G) k S,    V_new = P diag(beta) X,    P = (I + A)^-1,
    A = strict_lower(diag(beta) (Gamma * k k^T)),    A_qk = scale causal(Gamma * q k^T),
    O = scale diag(e^G) q S + A_qk V_new,    S' = e^G_last S + (diag(e^(G_last - G)) k)^T V_new.
The backward, with dS' the gradient of S' (four launches after the recompute):
1. recompute G, P and A_qk (chunk_prepare's kernels); the chunk-start states S come from the
   forward (its return_intermediate_states), or are recomputed (the Triton scan with STORE_STATES;
   its output discarded);
2. ``_reverse_scan_kernel``, grid ``(N * HV, V / BV)``: the state gradient slab ``dS [K, BV]`` in
   registers, chunks last to first:
       dV_new = A_qk^T dO + diag(e^(G_last - G)) k dS',    R = P^T dV_new   (stored, float32),
       dS = e^G_last dS' + scale (diag(e^G) q)^T dO - (diag(e^G) k)^T diag(beta) R,
   storing dS' per chunk (``[chunks, HV, K, V]``) and dh0 (float32) at the sequence's start;
3. ``_value_grads_kernel``, grid ``(chunks, HV)``, over the value columns in tiles of BV:
       X and V_new again (from S),  dv = diag(beta) R,
       dbeta = rowsum(R * X) - rowsum(strict(R V_new^T) * Gamma * k k^T),
       d(q k^T) = scale Gamma * causal(dO V_new^T),  d(k k^T) = -diag(beta) Gamma * strict(R V_new^T),
   and the scores' share of dG (their e^(G_i - G_j)) with X's e^G k S term; V_new, the two score
   gradients ``[BT, BT]`` per token row and that dG go to scratch;
4. ``_key_grads_kernel``, grid ``(chunks, HV)``, all K columns:
       dq = scale diag(e^G) dO S^T + d(q k^T) k,
       dk = diag(e^(G_last - G)) V_new dS'^T - diag(e^G beta) R S^T + d(q k^T)^T q
            + (d(k k^T) + d(k k^T)^T) k,
   the state terms' share of dG as rowsums of q and k against their state terms (G_last's, on the
   chunk's last token, from e^G_last S and the decayed keys), then dg as the reverse in-chunk cumsum
   of dG; dq and dk per value head (float32), summed per q/k head by qk_grads.input_grads (with the
   l2norm's backward).
Precision as the forward: products with bf16 operands for bf16 inputs (fp32 in the interpreter;
DELTA_SCAN_FP32_PRODUCTS below puts the delta rule's reverse scan on tf32), fp32 accumulation,
the state gradient fp32 in the scan. The stored chunk states S and dS' are in the products' operand
dtype (bf16 for bf16 inputs, as FLA stores its chunk states; ``FP32_STATES``:
float32, twice their bytes): they are the largest traffic, each written once and read by both
gradient kernels. The reverse scan is assembled for sm_90 by ptxas 12.9 or newer
(``launch.newer_ptxas``; CUDA 12.8's formed its wgmma descriptors from a wrong register: GDN's dh0
9e-2 off, illegal addresses at 16 columns; docs/notes/chunk-backward.md), and so are the value and
key kernels (the builds that passed the GPU suite; their descriptors read right under 12.8 too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastla.backends.triton import cdiv, chunk_prepare, interpreting, next_pow2
from fastla.backends.triton.chunk_delta import (
    ChunkConfig, _scan_kernel, _varlen_index, dense_inputs,
)
from fastla.backends.triton.chunk_index import BT, _chunk, _sequence
from fastla.backends.triton.launch import launcher, newer_ptxas
from fastla.backends.triton.activations import BETA_GIVEN
from fastla.core import call_plan
from fastla.core.problem import Problem

# Launch shapes at K = V = 128 (sm_90 compiles, tests/backends/test_triton_sm90.py), each the build
# that passed the GPU suite on an H100 (docs/notes/chunk-backward.md, twenty-ninth session): the
# scalar-gate reverse scan 16 columns on 4 warps and 2 stages (GDN: 552 -> 369 us against 32
# columns on 8 warps and 1 stage), the per-channel one (KDA) 32 columns on 8 warps and 1 stage
# (1.27 ms; the scalar gate's shape took 1.62); the value kernel 32-column tiles on 8 warps and 2
# stages (689 -> 521 us against 16 columns); the key kernel all 128 key columns on 8 warps and 1
# stage (633 us: at 2 stages, 580, its dk was wrong on the GPU for chunks of a few rows, the
# interpreter right). Registers on bf16 operands, none spilled: scans 179 and 198, value 226, key
# 238. GDN's kernels at B1 T8192 H16 HV32 (benchmarks/backward_profile.py): fwd + bwd 2413 us
# (2999 before these shapes and the state terms' move; FLA's 2535 in the same process, H100)
BLOCK_V = 32        # value columns per tile of _key_grads_kernel (and of the states' recompute)
SCAN_BLOCK_V = 16   # value columns per reverse-scan program (scalar gates)
SCAN_WARPS = 4
SCAN_STAGES = 2     # software-pipelining stages of the reverse scan's loop over chunks
CHANNEL_SCAN_BLOCK_V = 32   # the same for per-channel gates
CHANNEL_SCAN_WARPS = 8
CHANNEL_SCAN_STAGES = 1
VALUE_BLOCK_V = 32  # value columns per tile of _value_grads_kernel
VALUE_WARPS = 8
VALUE_STAGES = 2    # software-pipelining stages of the value and key kernels' loops over V
KEY_WARPS = 8
KEY_STAGES = 1
FP32_STATES = False     # the stored chunk states and their gradients in float32 (A/B; see the docstring)
# The delta rule's scalar-gate reverse scan on float32 (tf32) operands for bf16 inputs too (an A/B
# switch; off: bf16 operands as every other product here). Its bf16 build was wrong under ptxas 12.8
# (dh0 9.1e-2 from fp64 at B 2 T 400); under 12.9 it is right (2.9e-3; tf32 2.3e-3), passes the
# GPU suite and takes 640 us against tf32's 1025 (H100, docs/notes/chunk-backward.md)
DELTA_SCAN_FP32_PRODUCTS = False


@newer_ptxas                                    # CUDA 12.8's ptxas builds it wrong on sm_90 (launch.py)
@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _reverse_scan_kernel(
    q, k, kd, decay, beta, p_in, a_in, gcum, do, dht, dh_chunks, r_out, dh0, cu_seqlens, chunk_start, T, NT,
    scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, VARLEN: tl.constexpr, DELTA: tl.constexpr, GK: tl.constexpr,
):
    """Program (sequence x value head, V tile): dS from dht, chunks last to first; per chunk stores
    dS' (the gradient of the chunk's end state) and R = P^T dV_new (DELTA False, the plain rule:
    dv = dV_new itself); dh0 at the end. GK (per-channel gates): q, k are the prologue's qg (scale
    included) and kg per value head, with kd and decay = e^(G_last) [chunks, HV, K]:
    dV_new = A_qk^T dO + kd dS', dS = diag(decay) dS' + qg^T dO - kg^T diag(beta) R."""
    i_p = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    i_n, i_hv = i_p // HV, i_p % HV
    if GK:
        QK_HEADS: tl.constexpr = HV                                         # gated q / k: one per value head
        i_h = i_hv
    else:
        QK_HEADS: tl.constexpr = H
        i_h = i_hv // (HV // H)
    bos, eos, first_chunk = _sequence(cu_seqlens, chunk_start, i_n, T, NT, VARLEN)
    n_chunks = tl.cdiv(eos - bos, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_state = o_k[:, None] * V + o_v[None, :]                               # [BK, BV] in one head's state
    head_state = i_hv * K * V
    b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dS = tl.load(dht + i_n * HV * K * V + head_state + p_state, mask=m_h, other=0.0)
    r = tl.arange(0, BT)
    # (P and A_qk are stored as whole rows, zero above the diagonal: row masks and P's block mask
    # keep their loads vectorized, as the forward's; an element-wise triangle makes them 2-byte loads)
    lower_blocks = r[None, :] // 16 <= r[:, None] // 16
    off_kr = r[:, None] * (QK_HEADS * K) + o_k[None, :]                     # [BT, BK] in q, k, kd
    off_p = r[:, None] * (HV * BT) + r[None, :]                             # [BT, BT] in P, A_qk
    off_v = r[:, None] * (HV * V) + o_v[None, :]                            # [BT, BV] in dO, R
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        tl.store(dh_chunks + (first_chunk + c) * HV * K * V + head_state + p_state,
                 b_dS.to(dh_chunks.dtype.element_ty), mask=m_h)
        t0 = bos + c * BT
        base = t0 * HV + i_hv                                               # int64 chunk base
        m_t = r < eos - t0
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        qk_row0 = (t0 * QK_HEADS + i_h) * K
        b_q = tl.load(q + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)                         # [BT, BK]
        b_do = tl.load(do + base * V + off_v, mask=m_tv, other=0.0).to(tl.float32)               # [BT, BV]
        b_A = tl.load(a_in + base * BT + off_p, mask=m_t[:, None], other=0.0).to(DOT)             # [BT, BT]
        if GK:
            b_kd = tl.load(kd + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)
            b_decay = tl.load(decay + ((first_chunk + c) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)  # [BK]
            b_dvn = tl.dot(tl.trans(b_A), b_do.to(DOT)) + tl.dot(b_kd, b_dS.to(DOT))             # [BT, BV]
            b_dS = b_dS * b_decay[:, None] + tl.dot(tl.trans(b_q), b_do.to(DOT))
            b_eG = tl.full([BT], 1.0, tl.float32)                           # (kg carries e^G)
        else:
            last = tl.minimum(eos - t0, BT) - 1
            b_G = tl.load(gcum + base + r * HV, mask=m_t, other=0.0)                              # [BT]
            b_Gl = tl.load(gcum + base + last * HV)
            b_eG = tl.where(m_t, tl.exp(b_G), 0.0)
            # the rows' gate factors scale the [BT, BV] operands and products, not the [BT, BK] keys
            b_k = tl.load(k + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)                     # [BT, BK]
            b_dvn = (tl.dot(tl.trans(b_A), b_do.to(DOT))
                     + tl.where(m_t, tl.exp(b_Gl - b_G), 0.0)[:, None] * tl.dot(b_k, b_dS.to(DOT)))
            b_dS = b_dS * tl.exp(b_Gl) + tl.dot(tl.trans(b_q), ((scale * b_eG)[:, None] * b_do).to(DOT))
        if DELTA:
            if GK:
                b_k = tl.load(k + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)                 # kg
            b_P = tl.load(p_in + base * BT + off_p, mask=m_t[:, None] & lower_blocks, other=0.0).to(DOT)
            b_beta = tl.load(beta + base + r * HV, mask=m_t, other=0.0)
            b_r = tl.dot(tl.trans(b_P), b_dvn.to(DOT))                                           # R
            b_dS -= tl.dot(tl.trans(b_k), ((b_eG * b_beta)[:, None] * b_r).to(DOT))
        else:
            b_r = b_dvn
        tl.store(r_out + base * V + off_v, b_r, mask=m_tv)
    if STORE_DH0:
        tl.store(dh0 + i_n * HV * K * V + head_state + p_state, b_dS, mask=m_h)


@newer_ptxas                                    # (as the GPU suite ran it)
@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _value_grads_kernel(
    q, k, v, beta, p_in, gcum, h, do, r_in, vn_out, dqk_out, dkk_out, dv, dG_out, dbeta,
    cu_seqlens, chunk_index, T, NT, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, VARLEN: tl.constexpr,
    DELTA: tl.constexpr,
):
    """Program (chunk, value head), the value columns in tiles of BV: from S, dO and R, stores
    dv = diag(beta) R, V_new, dbeta, the gradients of q k^T and k k^T through A_qk and A (``[BT,
    BT]`` per token row) and the scores' share of dG (``[B, T, HV]``; _key_grads_kernel adds the
    state terms' and takes the cumsum). DELTA False (the plain rule): V_new = v and dv = R, neither
    beta nor A."""
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * BT
    base = t0 * HV + i_hv
    r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = r < eos - t0
    m_k = o_k < K
    last = tl.minimum(eos - t0, BT) - 1
    lower_blocks = r[None, :] // 16 <= r[:, None] // 16                     # (P: zero above its diagonal)
    off_p = r[:, None] * (HV * BT) + r[None, :]                             # [BT, BT] in P
    off_pT = r[None, :] * (HV * BT) + r[:, None]                            # the scratch, transposed tiles
    b_Gl = tl.load(gcum + base + last * HV)
    # rows past the sequence's end take G_last: Gamma's exponents stay <= 0 there (not inf * 0)
    b_G = tl.load(gcum + base + r * HV, mask=m_t, other=0.0)                                      # [BT]
    b_G = tl.where(m_t, b_G, b_Gl)
    b_eG = tl.where(m_t, tl.exp(b_G), 0.0)
    qk_row0 = (t0 * H + i_h) * K
    off_kr = r[:, None] * (H * K) + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    b_k = tl.load(k + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)                             # [BT, BK]
    if DELTA:
        b_beta = tl.load(beta + base + r * HV, mask=m_t, other=0.0)
        b_P = tl.load(p_in + base * BT + off_p, mask=m_t[:, None] & lower_blocks, other=0.0).to(DOT)      # [BT, BT]
    chunk_state = (i_c * HV + i_hv) * K * V

    # the [BT, BT] score tiles are held transposed (row j, column i): V_new comes out of a product,
    # and tl.trans of a product's result fed to another product miscompiles on Hopper (GLUON.md)
    b_dAqkT = tl.zeros([BT, BT], dtype=tl.float32)      # (dO V_new^T)^T = V_new dO^T
    b_RVT = tl.zeros([BT, BT], dtype=tl.float32)        # (R V_new^T)^T (dA = -strict of it)
    b_db = tl.zeros([BT], dtype=tl.float32)             # rowsum(R * X)
    b_tkg = tl.zeros([BT], dtype=tl.float32)            # e^G rowsum(diag(beta) R * k S)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        off_v = r[:, None] * (HV * V) + o_v[None, :]
        b_do = tl.load(do + base * V + off_v, mask=m_tv, other=0.0).to(DOT)                       # [BT, BV]
        b_r = tl.load(r_in + base * V + off_v, mask=m_tv, other=0.0)
        if DELTA:
            b_S = tl.load(h + chunk_state + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                          other=0.0).to(DOT)                                                      # [BK, BV]
            b_v = tl.load(v + base * V + off_v, mask=m_tv, other=0.0).to(tl.float32)             # [BT, BV]
            b_ks = tl.dot(b_k, b_S)                                                               # k S
            b_x = b_v - b_eG[:, None] * b_ks
            b_vn = tl.dot(b_P, (b_beta[:, None] * b_x).to(DOT))                                   # V_new
            b_dx = b_beta[:, None] * b_r
            b_tkg += b_eG * tl.sum(b_dx * b_ks, 1)
            tl.store(vn_out + base * V + off_v, b_vn.to(vn_out.dtype.element_ty), mask=m_tv)
            b_vnd = b_vn.to(DOT)
            b_RVT += tl.dot(b_vnd, tl.trans(b_r.to(DOT)))
            b_db += tl.sum(b_r * b_x, 1)
        else:
            b_vnd = tl.load(v + base * V + off_v, mask=m_tv, other=0.0).to(DOT)
            b_dx = b_r
        tl.store(dv + base * V + off_v, b_dx.to(dv.dtype.element_ty), mask=m_tv)
        b_dAqkT += tl.dot(b_vnd, tl.trans(b_do))

    # the scores' gradients, transposed (row j, column i: sums over i are over axis 1, over j axis
    # 0), each [BT, BT] tile dead as soon as it is used (registers)
    b_q = tl.load(q + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)                             # [BT, BK]
    upper = r[:, None] <= r[None, :]                                        # j <= i
    b_gamT = tl.where(upper, tl.exp(tl.where(upper, b_G[None, :] - b_G[:, None], 0.0)), 0.0)    # Gamma^T
    b_dqkT = tl.where(upper, scale * b_gamT * b_dAqkT, 0.0)                 # d(q k^T)^T through A_qk
    tl.store(dqk_out + base * BT + off_pT, b_dqkT.to(dqk_out.dtype.element_ty), mask=m_t[None, :])
    b_eT = b_dqkT * tl.dot(b_k, tl.trans(b_q))                              # (dA_qk * A_qk)^T
    b_dG = tl.sum(b_eT, 0) - tl.sum(b_eT, 1)
    if DELTA:
        b_tT = tl.where(r[:, None] < r[None, :], b_gamT * b_RVT, 0.0)
        b_kk = tl.dot(b_k, tl.trans(b_k))                                   # (symmetric)
        b_db -= tl.sum(b_tT * b_kk, 0)
        b_dkkT = -b_beta[None, :] * b_tT                                    # d(k k^T)^T through A
        tl.store(dkk_out + base * BT + off_pT, b_dkkT.to(dkk_out.dtype.element_ty), mask=m_t[None, :])
        b_eT = b_dkkT * b_kk                                                # (dA * A)^T
        b_dG += tl.sum(b_eT, 0) - tl.sum(b_eT, 1)
        tl.store(dbeta + base + r * HV, b_db, mask=m_t)
        b_dG -= b_tkg                                                       # X's e^G_i k_i S
    # dG_i through the scores' e^(G_i - G_j) (rows minus columns)
    tl.store(dG_out + base + r * HV, b_dG, mask=m_t)


@newer_ptxas                                    # (as the GPU suite ran it)
@triton.jit(do_not_specialize=["T", "NT"])     # as chunk_delta._scan_kernel
def _key_grads_kernel(
    q, k, beta, gcum, h, dh_chunks, do, r_in, vn_in, dqk_in, dkk_in, dG_in, dq, dk, dg, cu_seqlens, chunk_index,
    T, NT, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, VARLEN: tl.constexpr,
    DELTA: tl.constexpr,
):
    """Program (chunk, value head), all K key columns: this value head's share of dq and dk, the
    state terms over the value columns in tiles of BV, then the scores' terms (DELTA False: no
    R S^T nor k k^T terms; ``vn_in`` is v); then dg, the reverse in-chunk cumsum of dG: the scores'
    share (``dG_in``, from _value_grads_kernel) plus the state terms' (q and k against their state
    gradients, and G_last's on the chunk's last token)."""
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, c, bos, eos = _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN)
    t0 = bos + c * BT
    base = t0 * HV + i_hv
    r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = r < eos - t0
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    last = tl.minimum(eos - t0, BT) - 1
    off_p = r[:, None] * (HV * BT) + r[None, :]
    b_G = tl.load(gcum + base + r * HV, mask=m_t, other=0.0)                                      # [BT]
    b_Gl = tl.load(gcum + base + last * HV)
    b_eG = tl.where(m_t, tl.exp(b_G), 0.0)
    b_eD = tl.where(m_t, tl.exp(b_Gl - b_G), 0.0)
    chunk_state = (i_c * HV + i_hv) * K * V

    b_dqs = tl.zeros([BT, BK], dtype=tl.float32)        # dO S^T
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)        # V_new dS'^T
    b_dkx = tl.zeros([BT, BK], dtype=tl.float32)        # diag(e^G beta) R S^T
    b_sdS = tl.zeros([BK], dtype=tl.float32)            # rowsum(S * dS')
    if DELTA:
        b_beta = tl.load(beta + base + r * HV, mask=m_t, other=0.0)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        off_v = r[:, None] * (HV * V) + o_v[None, :]
        p_state_t = o_k[None, :] * V + o_v[:, None]                         # [BV, BK]: S^T
        m_ht = m_k[None, :] & m_v[:, None]
        b_St = tl.load(h + chunk_state + p_state_t, mask=m_ht, other=0.0)                          # [BV, BK]
        b_dSt = tl.load(dh_chunks + chunk_state + p_state_t, mask=m_ht, other=0.0)
        b_do = tl.load(do + base * V + off_v, mask=m_tv, other=0.0).to(DOT)                       # [BT, BV]
        b_vn = tl.load(vn_in + base * V + off_v, mask=m_tv, other=0.0).to(DOT)
        b_dqs += tl.dot(b_do, b_St.to(DOT))
        b_dkd += tl.dot(b_vn, b_dSt.to(DOT))
        if DELTA:
            b_r = tl.load(r_in + base * V + off_v, mask=m_tv, other=0.0)
            b_dkx += tl.dot(((b_eG * b_beta)[:, None] * b_r).to(DOT), b_St.to(DOT))
        b_sdS += tl.sum(b_St.to(tl.float32) * b_dSt.to(tl.float32), 0)
    qk_row0 = (t0 * H + i_h) * K
    off_kr = r[:, None] * (H * K) + o_k[None, :]
    b_q = tl.load(q + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)                             # [BT, BK]
    b_k = tl.load(k + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)
    # dG_i of the state terms: e^G_i in q S, e^(G_last - G_i) in the state update (G_last also
    # through e^G_last S); X's e^G_i k_i S is in dG_in (the value kernel's, on fp32 R)
    b_dq = scale * b_eG[:, None] * b_dqs
    b_dkd = b_eD[:, None] * b_dkd
    b_tkd = tl.sum(b_k.to(tl.float32) * b_dkd, 1)
    b_dG = tl.sum(b_q.to(tl.float32) * b_dq, 1) - b_tkd
    b_dGl = tl.sum(b_tkd, 0) + tl.exp(b_Gl) * tl.sum(b_sdS, 0)
    b_dG += tl.load(dG_in + base + r * HV, mask=m_t, other=0.0) + tl.where(r == last, b_dGl, 0.0)
    b_dG = tl.where(m_t, b_dG, 0.0)
    tl.store(dg + base + r * HV, tl.cumsum(b_dG, 0, reverse=True), mask=m_t)   # dg_t = sum over i >= t of dG_i
    b_dk = b_dkd - b_dkx
    # the scores' terms
    b_dqk = tl.load(dqk_in + base * BT + off_p, mask=m_t[:, None], other=0.0).to(DOT)             # [BT, BT]
    b_dq += tl.dot(b_dqk, b_k)
    b_dk += tl.dot(tl.trans(b_dqk), b_q)
    if DELTA:
        b_dkk = tl.load(dkk_in + base * BT + off_p, mask=m_t[:, None], other=0.0).to(DOT)
        b_dk += tl.dot(b_dkk, b_k) + tl.dot(tl.trans(b_dkk), b_k)
    off_kv = r[:, None] * (HV * K) + o_k[None, :]                           # [BT, BK] in dq, dk
    tl.store(dq + base * K + off_kv, b_dq, mask=m_tk)
    tl.store(dk + base * K + off_kv, b_dk, mask=m_tk)


@dataclass(frozen=True)
class Call:
    """What the launches of one backward call share (both rules: this module's and
    chunk_channel_backward's)."""
    p: Problem                          # dense inputs
    NT: int                             # chunks per dense sequence
    total: int                          # chunks in the batch
    cu: torch.Tensor | None             # varlen: offsets [N + 1], chunk index [chunks, 2], first chunks [N]
    chunk_index: torch.Tensor | None
    chunk_start: torch.Tensor | None
    op_dtype: torch.dtype               # the products' operands (bf16 for bf16 inputs on a GPU)
    dot: object
    state_dtype: torch.dtype            # the stored chunk states and their gradients
    BK: int
    BVF: int
    BV: int

    @property
    def tables(self):
        return self.cu, self.chunk_index

    def index(self, dummy):
        """The kernels' (cu_seqlens, chunk_index) arguments (``dummy`` for dense batches)."""
        return (self.cu, self.chunk_index) if self.cu is not None else (dummy, dummy)

    def starts(self, dummy):
        """The kernels' (cu_seqlens, chunk_start) arguments (``dummy`` for dense batches)."""
        return (self.cu, self.chunk_start) if self.cu is not None else (dummy, dummy)


def call_of(p: Problem) -> Call:
    p = dense_inputs(p)
    NT = cdiv(p.T, BT)
    if p.cu_seqlens is not None:
        chunk_index, chunk_start, total, _, _ = _varlen_index(p)
        cu = p.cu_seqlens
    else:
        total, chunk_index, chunk_start, cu = p.B * NT, None, None, None
    bf16 = p.q.dtype == torch.bfloat16 and not interpreting()
    op_dtype = torch.bfloat16 if bf16 else torch.float32
    BK, BVF = max(16, next_pow2(p.K)), max(16, next_pow2(p.V))
    return Call(p, NT, total, cu, chunk_index, chunk_start, op_dtype, tl.bfloat16 if bf16 else tl.float32,
                torch.float32 if FP32_STATES else op_dtype, BK, BVF, min(BLOCK_V, BVF))


def chunk_states(c: Call, q, k, kd, decay, beta, inverse, scores, gcum, gk: bool) -> torch.Tensor:
    """The chunk-start states ``[chunks, HV, K, V]`` (the forward's scan with STORE_STATES; its
    output discarded). ``q``, ``k``: the raw ones, or qg, kg with ``gk`` (per-channel gates)."""
    p = c.p
    states = call_plan.empty((max(c.total, 1), p.HV, p.K, p.V), c.state_dtype, p.device)
    if c.total:
        config = ChunkConfig(segment_chunks=0)
        o_scratch = call_plan.empty((p.B, p.T, p.HV, p.V), p.o_dtype, p.device)
        h0 = p.initial_state
        launcher(_scan_kernel, p.T, c.NT)[(p.N * p.HV, cdiv(p.V, c.BV))](
            q, k, p.v, beta, inverse, scores, gcum, gcum, gcum, kd, decay, o_scratch,
            h0 if h0 is not None else o_scratch, o_scratch, states, *c.starts(gcum), gcum, gcum, p.T, c.NT, p.scale,
            H=p.H, HV=p.HV, K=p.K, V=p.V, BT=BT, BK=c.BK, BV=c.BV, SK=p.V, SV=1, DOT=c.dot, HAS_H0=h0 is not None,
            STORE_FINAL=False, L2NORM=False, VARLEN=c.cu is not None, SEG=0, BETA=BETA_GIVEN, STORE_STATES=True,
            GK=gk, DELTA=p.delta, num_warps=config.scan_warps, num_stages=config.scan_stages)
    return states


def reverse_scan(c: Call, q, k, kd, decay, beta, inverse, scores, gcum, do, dht, gk: bool):
    """``(dS' per chunk [chunks, HV, K, V], R [B, T, HV, V] fp32 (the plain rule: dv), dh0 or None)``."""
    p = c.p
    f32 = torch.float32
    dh_chunks = call_plan.empty((max(c.total, 1), p.HV, p.K, p.V), c.state_dtype, p.device)
    r_buf = call_plan.empty((p.B, p.T, p.HV, p.V), f32, p.device)
    dh0 = call_plan.empty((p.N, p.HV, p.K, p.V), f32, p.device) if p.initial_state is not None else None
    if dht is not None:
        dht = dht.to(f32).contiguous()
    scan_dot = tl.float32 if DELTA_SCAN_FP32_PRODUCTS and p.delta and not gk else c.dot
    columns, warps, stages = ((CHANNEL_SCAN_BLOCK_V, CHANNEL_SCAN_WARPS, CHANNEL_SCAN_STAGES) if gk
                              else (SCAN_BLOCK_V, SCAN_WARPS, SCAN_STAGES))
    BV = min(columns, c.BVF)
    launcher(_reverse_scan_kernel, p.T, c.NT)[(p.N * p.HV, cdiv(p.V, BV))](
        q, k, kd, decay, beta, inverse, scores, gcum, do, dht if dht is not None else gcum, dh_chunks, r_buf,
        dh0 if dh0 is not None else gcum, *c.starts(gcum), p.T, c.NT, p.scale, H=p.H, HV=p.HV, K=p.K, V=p.V, BT=BT,
        BK=c.BK, BV=BV, DOT=scan_dot, HAS_DHT=dht is not None,
        STORE_DH0=dh0 is not None, VARLEN=c.cu is not None, DELTA=p.delta, GK=gk,
        num_warps=warps, num_stages=stages)
    return dh_chunks, r_buf, dh0


def backward(p: Problem, do: torch.Tensor, dht: torch.Tensor | None, states: torch.Tensor | None = None):
    """Gradients ``(dq, dk [B, T, HV, K] per value head, dv [B, T, HV, V], dg [B, T, HV], dbeta
    [B, T, HV] or None, dh0 [N, HV, K, V] or None)`` (float32; dv in v's dtype) of the chunked forward of ``p`` (the
    delta rule, or the plain rule with ``p.delta`` False: no beta), whose q, k, v, g (float32 log
    decay, or None: no decay), beta (float32) and initial state (K-first, float32) are the
    activated ones: no gate, l2norm nor beta sigmoid in the op, no g_gamma, K-first states. ``do``
    is dO ``[B, T, HV, V]``, ``dht`` the final state's gradient ``[N, HV, K, V]`` or None,
    ``states`` the forward's chunk-start states ``[chunks, HV, K, V]`` in the operand dtype (None:
    recomputed here)."""
    c = call_of(p)
    p = c.p
    B, T, H, HV, K, V = p.B, p.T, p.H, p.HV, p.K, p.V
    dev, f32, total = p.device, torch.float32, c.total
    q, k = (p.q, p.k) if p.q.dtype == c.op_dtype else (p.q.to(c.op_dtype), p.k.to(c.op_dtype))
    do = do.contiguous()

    # 1. G, P (delta rule), A_qk and (unless the forward kept them) the chunk-start states, as the
    # forward computes them
    config = ChunkConfig(segment_chunks=0)
    gcum = call_plan.empty((B, T, HV), f32, dev)
    scores = call_plan.empty((B, T, HV, BT), c.op_dtype, dev)
    inverse = call_plan.empty((B, T, HV, BT), c.op_dtype, dev) if p.delta else scores
    beta = p.beta if p.delta else gcum
    if total:
        if p.delta:
            g = p.g if p.g is not None else call_plan.full((B, T, HV), 0.0, f32, dev)      # (no gate: no decay)
            chunk_prepare.launch(p, g, p.beta, BETA_GIVEN, total, c.tables, gcum, inverse, c.dot, config)
        else:
            chunk_prepare.launch_gate_cumsum(p, total, c.tables, gcum)
        chunk_prepare.launch_scores(p, q, k, total, c.tables, gcum, scores, None, None, c.dot, config)
    if states is None or states.dtype != c.state_dtype:
        states = chunk_states(c, q, k, gcum, gcum, beta, inverse, scores, gcum, gk=False)

    # 2. the reverse scan: dS' per chunk, R (the plain rule: dv), dh0
    dh_chunks, r_buf, dh0 = reverse_scan(c, q, k, gcum, gcum, beta, inverse, scores, gcum, do, dht, gk=False)

    # 3. the gradients, chunk by chunk: dv, V_new, dg, dbeta and the scores' gradients, then dq, dk
    dq, dk = (call_plan.empty((B, T, HV, K), f32, dev) for _ in range(2))
    dv = call_plan.empty((B, T, HV, V), p.v.dtype, dev)
    dg = call_plan.empty((B, T, HV), f32, dev)
    dbeta = call_plan.empty((B, T, HV), f32, dev) if p.delta else None
    if total:
        v_new = call_plan.empty((B, T, HV, V), c.op_dtype, dev) if p.delta else p.v
        dqk = call_plan.empty((B, T, HV, BT), c.op_dtype, dev)
        dkk = call_plan.empty((B, T, HV, BT), c.op_dtype, dev) if p.delta else dqk
        launcher(_value_grads_kernel, T, c.NT)[(total, HV)](
            q, k, p.v, beta, inverse, gcum, states, do, r_buf, v_new, dqk, dkk, dv, dg,            # (dg: the scores' dG)
            dbeta if dbeta is not None else gcum, *c.index(gcum), T, c.NT, p.scale, H=H, HV=HV, K=K, V=V, BT=BT,
            BK=c.BK, BV=min(VALUE_BLOCK_V, c.BVF), DOT=c.dot, VARLEN=c.cu is not None, DELTA=p.delta,
            num_warps=VALUE_WARPS, num_stages=VALUE_STAGES)
        launcher(_key_grads_kernel, T, c.NT)[(total, HV)](
            q, k, beta, gcum, states, dh_chunks, do, r_buf, v_new, dqk, dkk, dg, dq, dk, dg, *c.index(gcum), T, c.NT,
            p.scale, H=H, HV=HV, K=K, V=V, BT=BT, BK=c.BK, BV=c.BV, DOT=c.dot, VARLEN=c.cu is not None,
            DELTA=p.delta, num_warps=KEY_WARPS, num_stages=KEY_STAGES)
    return dq, dk, dv, dg, dbeta, dh0
