"""Triton chunked forward of the gated delta rule (GDN) and of KDA: prologue, then a scan that writes the output.

Inputs as the public op takes them (``dense_inputs`` copies strided ones, as FLA does): q, k
``[B, T, H, K]`` (GVA: value head ``j`` reads head ``j // (HV // H)``), v ``[B, T, HV, V]``,
g / beta ``[B, T, HV]`` (raw when the gate or the beta sigmoid is computed in the op); the
l2norm of q and k, the GDN gate ``-exp(A_log) * softplus(g + dt_bias)`` and the beta sigmoid
are applied inside the kernels.
Dense batches need no index tensors; varlen batches use a host-built chunk index, cached per
``cu_seqlens`` (so graph capture after one eager call copies nothing).

Prologue (chunk_prepare.py), token-parallel: per chunk and value head G = cumsum(g) and
    P = (I + A)^-1,  A = strict_lower(beta_i (k_i . k_j) exp(G_i - G_j))  [BT, BT] (bf16),
the causal scores A_qk = scale diag(rq) q k^T diag(rk) e^(G_i - G_j) (bf16) and 1 / |q|, 1 / |k|.
Scan, ``_scan_kernel``, grid ``(N * HV, V / BV)``: the state slab ``S [K, BV]`` (fp32) in
registers, per chunk
    V_new = P diag(beta) (v - diag(rk e^G) k S),
    O = diag(scale rq e^G) q S + A_qk V_new                        (stored),
    S = e^G_last S + k^T diag(rk e^(G_last - G)) V_new,
so W and U of the WY form, V_new and the chunk states never reach HBM (the chunk states are
stored only for return_intermediate_states); and the final state. With segments (sequence
parallelism, ``segment_length``) the same kernel runs a summary pass (SEG 1, no output) and a
replay pass (SEG 2) around ``_segment_combine_kernel``. KDA (per-channel gate ``gk``
``[B, T, HV, K]``) runs its own prologue (chunk_prepare_kda.py) and the scan's ``GK`` step.
The plain rule (GLA, Simple GLA, Lightning: ``DELTA`` False) has V_new = v: no P, beta nor k S;
its scalar gate (``g`` and / or the constant ``g_gamma``) takes chunk_prepare's gate cumsum before
the scores, GLA's per-channel gate KDA's prologue without P and the gated keys.
The Gluon tier (backends/gluon) runs its own sm_90 kernel for the GDN sequence passes and
reuses the rest through ``run``.

Precision as FLA's chunk kernels: bf16 operands with fp32 accumulation for the products with
the state, the scores and P (bf16 inputs; fp32 operands otherwise), tf32 for the inverse's
block merges, fp32 state. Budget (K = V = 128, sm_90, checked in tests/backends/test_triton_sm90.py):
scan at BV 32 / 4 warps about 233 registers, no spill, 111 KB of shared memory at two stages
(165 KB at three). Measurements: docs/notes/gdn-prefill.md.
"""
from __future__ import annotations

import collections
import functools
import heapq
import itertools
from collections import OrderedDict
import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastla.backends.triton import cdiv, chunk_prepare, chunk_prepare_kda, interpreting, next_pow2, sm_count
from fastla.backends.triton.chunk_index import BT, _sequence
from fastla.backends.triton.chunk_prepare import _activate_beta
from fastla.backends.triton.launch import launcher
from fastla.backends.triton.activations import BETA_GIVEN, BETA_SIGMOID, BETA_SIGMOID2
from fastla.core import call_plan
from fastla.core.problem import Problem

# T and NT stay runtime values: the variant compiled for T = 1 (the chunk loop folded into straight-
# line code) faulted on the H200 (illegal address, bf16, K = V = 128; cause not found), while the
# general kernel ran T = 63 and 65; a variant per T = 1 would cost a compile too
@triton.jit(do_not_specialize=["T", "NT"])
def _scan_kernel(
    q, k, v, beta, p_in, a_in, rq, rk, gcum, kd, decay, o, h0, ht, h_chunks, cu_seqlens, chunk_start, segments,
    seg_state, T, NT, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SK: tl.constexpr, SV: tl.constexpr, DOT: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, L2NORM: tl.constexpr,
    VARLEN: tl.constexpr, SEG: tl.constexpr, BETA: tl.constexpr,
    STORE_STATES: tl.constexpr, GK: tl.constexpr, DELTA: tl.constexpr,
):
    """SEG 0: program (sequence x value head, V tile) runs a whole sequence from h0.
    SEG 1 (segment summary): program (segment x value head, tile of the V + K columns) runs one
    segment from a zero state in the V columns and from the identity in the K extra columns:
    it ends with [E | Phi], the segment's end state from zero and its exact transition.
    SEG 2 (segment replay): as SEG 0 over one segment, from its start state in ``seg_state``.
    Per chunk, from P = (I + A)^-1, the raw keys k, v, beta and 1 / |k| (rk):
    V_new = P diag(beta) (v - diag(rk e^G) k S), S = e^G_last S + k^T diag(rk e^(G_last - G)) V_new.
    SEG 0 and 2 write the output too, from the raw queries, 1 / |q| (rq) and the causal scores
    A = scale diag(rq) q k^T diag(rk) e^(G_i - G_j) of the prologue,
    O = scale diag(rq e^G) q S + A V_new, so neither
    V_new nor the chunk states reach HBM (STORE_STATES: the chunk-start states are stored too,
    for return_intermediate_states).
    GK (KDA, per-channel gates): q, k are the prologue's gated qg = scale q e^G and kg = k e^G
    [B, T, HV, K] (chunk_prepare_kda.py), kd = k e^(G_last - G) and decay = e^(G_last) per chunk
    [chunks, HV, K]: V_new = P diag(beta) (v - kg S), O = qg S + A V_new,
    S = diag(decay) S + kd^T V_new.
    DELTA False (the plain rule: GLA, Simple GLA, Lightning): V_new = v, so neither P, beta nor
    k S is read (kd and qg from the GLA prologue with GK; G, the scores and the raw q, k otherwise)."""
    i_p = tl.program_id(0).to(tl.int64)                                    # axis 0: up to 2^31 - 1 programs
    i_v = tl.program_id(1)
    i_hv = i_p % HV
    if GK:
        QK_HEADS: tl.constexpr = HV                                         # gated q / k: one per value head
        i_h = i_hv
    else:
        QK_HEADS: tl.constexpr = H
        i_h = i_hv // (HV // H)                                             # GVA: the q/k head
    if SEG == 0:
        i_n = i_p // HV
        bos, eos, first_chunk = _sequence(cu_seqlens, chunk_start, i_n, T, NT, VARLEN)
        c_begin = 0
        c_end = tl.cdiv(eos - bos, BT)
    else:
        i_s = i_p // HV                                                     # segment: (n, c0, chunks, last)
        i_n = tl.load(segments + 4 * i_s).to(tl.int64)
        bos, eos, first_chunk = _sequence(cu_seqlens, chunk_start, i_n, T, NT, VARLEN)
        c_begin = tl.load(segments + 4 * i_s + 1).to(tl.int64)
        c_end = c_begin + tl.load(segments + 4 * i_s + 2)
        is_last = tl.load(segments + 4 * i_s + 3) != 0
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)                                       # SEG 1: V + K columns
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_tile = o_k[:, None] * SK + o_v[None, :] * SV                          # [BK, BV] inside one head state
    state = i_hv * K * V

    if SEG == 1:
        b_S = tl.where(o_k[:, None] == (o_v - V)[None, :], 1.0, 0.0)        # [0 | I]
    elif SEG == 2:
        b_S = tl.load(seg_state + (i_s * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_h,
                      other=0.0)
    else:
        b_S = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            b_S = tl.load(h0 + i_n * HV * K * V + state + p_tile, mask=m_h, other=0.0).to(tl.float32)

    r = tl.arange(0, BT)
    off_kr = r[:, None] * (QK_HEADS * K) + o_k[None, :]                     # [BT, BK] in q, k, kd
    off_p = r[:, None] * (HV * BT) + r[None, :]                             # [BT, BT] in P
    lower_blocks = r[None, :] // 16 <= r[:, None] // 16
    off_v = r[:, None] * (HV * V) + o_v[None, :]                            # [BT, BV]
    for c in range(c_begin, c_end):
        if STORE_STATES:
            tl.store(h_chunks + (first_chunk + c) * HV * K * V + state + p_tile,
                     b_S.to(h_chunks.dtype.element_ty), mask=m_h)             # the chunk's start state
        t0 = bos + c * BT
        base = t0 * HV + i_hv                                               # int64 chunk base
        m_t = r < eos - t0
        if K == BK:
            m_tk = m_t[:, None]                                             # rows only: [BT, 1]
        else:
            m_tk = m_t[:, None] & m_k[None, :]
        if V % BV == 0 and SEG != 1:
            m_tv = m_t[:, None]
        else:
            m_tv = m_t[:, None] & m_v[None, :]
        if DELTA:
            b_beta = _activate_beta(tl.load(beta + base + r * HV, mask=m_t, other=0.0), m_t, BETA)
            b_P = tl.load(p_in + base * BT + off_p, mask=m_t[:, None] & lower_blocks, other=0.0).to(DOT)  # [BT, BT]
        qk_row0 = (t0 * QK_HEADS + i_h) * K
        if DELTA or not GK:
            b_k = tl.load(k + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)                    # [BT, BK]
        b_v = tl.load(v + base * V + off_v, mask=m_t[:, None] & (o_v < V)[None, :], other=0.0).to(tl.float32)
        b_Sd = b_S.to(DOT)
        if DELTA:
            b_x = tl.dot(b_k, b_Sd)                                                               # [BT, BV]: k S
        if SEG != 1:
            b_q = tl.load(q + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)                     # [BT, BK]
            b_qs = tl.dot(b_q, b_Sd)                                                              # [BT, BV]: q S
        if GK:
            if DELTA:
                b_vn = tl.dot(b_P, (b_beta[:, None] * (b_v - b_x)).to(DOT))                      # [BT, BV]
            else:
                b_vn = b_v
            b_kd = tl.load(kd + qk_row0 + off_kr, mask=m_tk, other=0.0).to(DOT)                  # [BT, BK]
            b_decay = tl.load(decay + ((first_chunk + c) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)  # [BK]
            b_S = b_S * b_decay[:, None] + tl.dot(tl.trans(b_kd), b_vn.to(DOT))
            if SEG != 1:
                b_A = tl.load(a_in + base * BT + off_p, mask=m_t[:, None], other=0.0).to(DOT)      # [BT, BT]
                b_o = b_qs + tl.dot(b_A, b_vn.to(DOT))
                tl.store(o + base * V + off_v, b_o.to(o.dtype.element_ty), mask=m_tv)
        else:
            last = tl.minimum(eos - bos - c * BT, BT) - 1
            b_Gl = tl.load(gcum + base + last * HV)                         # G at the chunk's last token
            b_G = tl.load(gcum + base + r * HV, mask=m_t, other=0.0)                              # [BT]
            b_rk = tl.full([BT], 1.0, tl.float32)
            if L2NORM:
                b_rk = tl.load(rk + t0 * H + i_h + r * H, mask=m_t, other=0.0)
            if DELTA:
                b_y = b_beta[:, None] * (b_v - (b_rk * tl.exp(b_G))[:, None] * b_x)
                b_vn = tl.dot(b_P, b_y.to(DOT))                                                   # [BT, BV]
            else:
                b_vn = b_v
            b_vd = b_vn * tl.where(m_t, b_rk * tl.exp(b_Gl - b_G), 0.0)[:, None]
            b_S = b_S * tl.exp(b_Gl) + tl.dot(tl.trans(b_k), b_vd.to(DOT))    # [BK, BV]
            if SEG != 1:
                b_rq = tl.full([BT], 1.0, tl.float32)
                if L2NORM:
                    b_rq = tl.load(rq + t0 * H + i_h + r * H, mask=m_t, other=0.0)
                b_A = tl.load(a_in + base * BT + off_p, mask=m_t[:, None], other=0.0).to(DOT)      # [BT, BT]
                b_o = (scale * b_rq * tl.exp(b_G))[:, None] * b_qs + tl.dot(b_A, b_vn.to(DOT))
                tl.store(o + base * V + off_v, b_o.to(o.dtype.element_ty), mask=m_tv)

    if SEG == 1:
        tl.store(seg_state + (i_s * HV + i_hv) * K * (V + K) + o_k[:, None] * (V + K) + o_v[None, :], b_S,
                 mask=m_k[:, None] & (o_v < V + K)[None, :])
    elif STORE_FINAL:
        if SEG == 2:
            tl.store(ht + i_n * HV * K * V + state + p_tile, b_S.to(ht.dtype.element_ty), mask=m_h & is_last)
        else:
            tl.store(ht + i_n * HV * K * V + state + p_tile, b_S.to(ht.dtype.element_ty), mask=m_h)


@triton.jit
def _segment_combine_kernel(
    summary, seg_start, h0, seq_segments,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SK: tl.constexpr, SV: tl.constexpr, HAS_H0: tl.constexpr, ALL_SUMMARIES: tl.constexpr,
):
    """Program (sequence x value head, V tile): start states of a sequence's segments in order,
    S_0 = h0, S_{s+1} = Phi_s S_s + E_s, from the summaries [E_s | Phi_s] (fp32, tf32 products).
    A last segment has no summary (no segment starts after it): segment s of sequence n has
    summary s - n (each sequence before n has one last segment), or s with ``ALL_SUMMARIES``."""
    i_p = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    i_n, i_hv = i_p // HV, i_p % HV
    o_k = tl.arange(0, BK)
    o_j = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_h = m_k[:, None] & (o_v < V)[None, :]
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_S = tl.load(h0 + (i_n * HV + i_hv) * K * V + o_k[:, None] * SK + o_v[None, :] * SV, mask=m_h,
                      other=0.0).to(tl.float32)
    s0 = tl.load(seq_segments + 2 * i_n).to(tl.int64)
    count = tl.load(seq_segments + 2 * i_n + 1)
    for j in range(0, count - 1):
        i_s = s0 + j
        tl.store(seg_start + (i_s * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :], b_S, mask=m_h)
        i_sum = i_s if ALL_SUMMARIES else i_s - i_n
        base = summary + (i_sum * HV + i_hv) * K * (V + K) + o_k[:, None] * (V + K)
        b_E = tl.load(base + o_v[None, :], mask=m_h, other=0.0)                                   # [BK, BV]
        b_Phi = tl.load(base + V + o_j[None, :], mask=m_k[:, None] & (o_j < K)[None, :], other=0.0)  # [BK, BK]
        b_S = tl.dot(b_Phi, b_S, input_precision="tf32") + b_E
    i_s = s0 + count - 1
    tl.store(seg_start + (i_s * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :], b_S, mask=m_h)


@dataclass(frozen=True)
class ChunkConfig:
    """Launch choices of the kernels (measured: docs/notes/gdn-prefill.md)."""
    inverse_warps: int = 1
    inverse_stages: int = 1
    inverse_heads: int = 4              # value heads per inverse program (a divisor of HV / H up to this,
                                        # while 6 programs per SM remain: chunk_prepare.values_per_program)
    scan_block_v: int = 32
    scan_warps: int = 4
    scan_stages: int = 2
    segment_chunks: int | None = None   # sequence parallelism: chunks per segment (None: heuristic, 0: off)
    scores_warps: int = 4
    # the segment combine: one step (Phi_s S_s + E_s, Phi_s 64 KB at K = 128) per segment but the
    # last, in order
    combine_warps: int = 4
    combine_stages: int = 1
    combine_block_v: int = 32           # value columns per combine program (the chain's product: K x K x this)
    # KDA prologue (chunk_prepare_kda.py): warps and channels per slice. One warp measured fastest
    # (no barriers; 1x8k H64 both launches 1005 us vs 1468 at 2 warps and 1765 at 4 / 32 before
    # the blocks were made independent, 1031 us after; docs/notes/kda-prefill.md); at 16 channels
    # no spill with the gate in the op, 8 bytes with a precomputed gate (32 channels: 40-208)
    kda_prepare_warps: int = 1
    kda_prepare_block_k: int = 16
    kda_prepare_maxnreg: int | None = None   # register cap (more programs per SM; spills past ~168)


def default_config(p: Problem, segment_gain: float | None = None) -> ChunkConfig:
    """Measured on the H200 (docs/notes/gdn-prefill.md, benchmarks/results/gdn_prefill_sweep*.json).
    The scan (output fused) runs 32-column state tiles: 233 registers and 111 KB of shared memory
    at two stages, two programs per SM. When one program per SM covers every lane, three stages
    (165 KB, one program per SM) are faster (1x32k HV32: 1.25 ms vs 1.61, 1x8k HV16: 0.26 vs 0.34);
    with more lanes two stages are (1x32k HV64: 1.80 ms vs 2.56). 64-column tiles spill at 4 warps
    and lose at 8 (one program per SM: 1x32k HV64 2.34 ms). Sequences are split into segments
    when the plan predicts a gain (1x32k HV8 scan: 0.44 ms split at BV 32 vs 1.99 whole at BV 64).
    The plan is cached per (chunk counts, heads, head dims, SMs, gain): the split's search is host
    work that grows with the number of sequences. ``segment_gain``: segment_length's threshold,
    by the tier that runs the segment summaries (the sm_90 tier's is cheaper; None: this tier's)."""
    gain = SEGMENT_GAIN if segment_gain is None else segment_gain
    config = _planned_config(_chunk_counts(p), p.HV, p.V, p.K, sm_count(p.device), gain)
    if p.gk is not None:
        # KDA's scan reads three [BT, K] tiles per chunk (kg, kd, qg): 64-column tiles at 8 warps
        # (benchmarks/results/kda_prefill_sweep-v1.json: 1x8k H64 scan 544 us vs 988 at 32 columns)
        config = dataclasses.replace(config, scan_block_v=64, scan_warps=8, scan_stages=2)
    return config


@functools.lru_cache(maxsize=1024)
def _planned_config(counts: tuple[int, ...], HV: int, V: int, K: int, sms: int, gain: float) -> ChunkConfig:
    length = segment_length(len(counts) * HV, cdiv(V, 64), cdiv(V + K, 64), counts, sms, gain)
    if length:
        return ChunkConfig(segment_chunks=length)
    if len(counts) * HV * cdiv(V, 32) <= sms:
        return ChunkConfig(scan_stages=3, segment_chunks=0)
    return ChunkConfig(segment_chunks=0)


class _HostTables:
    """Small index tensors built on the host once per key and kept (least recently used out), so
    that repeated calls, and CUDA-graph capture after one eager call, copy nothing. Tables used
    while a graph is being captured are pinned: the graph keeps their addresses, so they are
    never evicted."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self.cache: OrderedDict = OrderedDict()
        self.pinned: dict = {}

    def cached(self, key) -> bool:
        return key in self.cache or key in self.pinned

    def get(self, key, build, pin: bool = False):
        hit = self.pinned.get(key)
        if hit is None:
            hit = self.cache.get(key)
            if hit is None:
                with call_plan.unwatched():
                    hit = self.cache[key] = build()
                if len(self.cache) > self.limit:
                    self.cache.popitem(last=False)
            self.cache.move_to_end(key)
            if pin:
                self.pinned[key] = self.cache.pop(key)
        call_plan.keep_constants(*hit)
        return hit


HOST_TABLES = _HostTables()


def _capturing(p: Problem) -> bool:
    return p.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _varlen_key(p: Problem):
    return "chunks", tuple(p.cu_seqlens_host), p.device


def _varlen_index(p: Problem):
    """(the (sequence, chunk) pair of every prepare/output program [chunks, 2] int32, each
    sequence's first chunk [N] int64, the number of chunks, the sequences' orders [2, N] int32:
    row 0 longest first (ties by index), row 1 as given; a scan that takes whole sequences
    through a table (the sm_90 ones) starts the longest lanes first; the offsets [N + 1] int64
    on the device, for calls that give them only on the host)."""
    def build():
        counts = _chunk_counts(p)
        starts = [0] + list(itertools.accumulate(counts))[:-1]
        pairs = [(n, c) for n, count in enumerate(counts) for c in range(count)]
        longest_first = sorted(range(len(counts)), key=lambda n: -counts[n])
        return (torch.tensor(pairs or [(0, 0)], dtype=torch.int32, device=p.device),
                torch.tensor(starts, dtype=torch.int64, device=p.device), len(pairs),
                torch.tensor([longest_first, list(range(len(counts)))], dtype=torch.int32, device=p.device),
                torch.tensor(p.cu_seqlens_host, dtype=torch.int64, device=p.device))
    return HOST_TABLES.get(_varlen_key(p), build, pin=_capturing(p))


MIN_SEGMENT_CHUNKS = 8          # shortest segment considered
# The summary pass over every segment, the last ones' summaries unread (before v28), instead of
# only those that start another segment (A/B)
LAST_SEGMENT_SUMMARIES = False
PROGRAMS_PER_SM = 2             # scan programs resident per SM (registers and shared memory)
# split only when the plan's predicted steps are below this fraction of the whole-sequence steps:
# a step under a full grid costs ~1.8x one on a lightly loaded GPU (1x32k HV8: 1.18 us per step
# unsplit at BV 32, 2.15 us split at BV 64), and the split needs a ~25% margin to pay
SEGMENT_GAIN = 0.4


def segment_length(lanes: int, tiles: int, summary_tiles: int, chunk_counts, sms: int,
                   gain: float = SEGMENT_GAIN) -> int:
    """Chunks per segment for intra-card sequence parallelism, or 0 for none.

    Cost model in chunk-steps of one scan program, with R = PROGRAMS_PER_SM x SMs programs
    resident, each pass's programs taken longest first by whichever of the R slots frees first
    (``_makespan``): whole sequences are ``tiles`` programs a sequence and value head as long as
    the sequence; segments of L chunks are a summary pass (``summary_tiles`` programs over the V +
    K columns for each segment but a sequence's last, L steps each), then the replay (``tiles``
    programs a segment, as long as it), plus one step per segment of the longest sequence for the
    combine (the kernel runs one fewer since v20; the count is kept, so the plans measured with it
    stay). For equal segments this is the waves model the plans were measured with (v9-v14: a pass
    takes ceil(programs / R) waves); with mixed lengths the short sequences fill the waves beside
    the long ones instead of each counting as long as the longest (the replay dispatches in table
    order, not longest first: a model, HV 16 varlen 9x16k at 24 chunks 45 steps in table order
    against its 40). Since the last segments' summaries no longer count (v28), some dense plans
    moved too (e.g. 3x8k HV4 16 -> 24 chunks; 65 of 3072 power-of-two shapes at K, V 64 / 128,
    none of the registry's), unmeasured. Ties go to the longer segment:
    the model counts a combine as one step and the summaries' fixed costs not at all (1x8k HV 8
    ties 8 and 16 chunks: 200 us at 8, 180 at 16, gdn_prefill_sweep-v11-small-heads.json).
    ``lanes`` = sequences x value heads, ``sms`` the GPU's SM count; a split must cost below
    ``gain`` x the whole sequences' steps (the summary pass's tier sets it)."""
    longest = max(chunk_counts, default=0)
    resident = PROGRAMS_PER_SM * sms
    heads = lanes // max(len(chunk_counts), 1)
    per_count = collections.Counter(chunk_counts)
    whole = _makespan(collections.Counter({c: n * heads * tiles for c, n in per_count.items()}), resident)
    best, best_cost = 0, float("inf")
    length = MIN_SEGMENT_CHUNKS
    while length < longest:
        replay, summarized = collections.Counter(), 0
        for c, n in per_count.items():
            full, rest = divmod(c, length)
            replay[length] += n * full * heads * tiles
            if rest or not full:
                replay[rest] += n * heads * tiles          # (an empty sequence: one empty segment)
            segments = max(1, cdiv(c, length))
            summarized += n * (segments if LAST_SEGMENT_SUMMARIES else segments - 1)
        summary = collections.Counter({length: summarized * heads * summary_tiles})
        combine = -(-longest // length)
        # (a bound first: each pass takes at least one segment's steps and its work spread over
        # every slot; many sequences fill the grid whole, and the list scheduling is host time)
        work = sum(steps * n for passes in (summary, replay) for steps, n in passes.items()) / resident
        if max(work, 2 * length) + combine < min(gain * whole, best_cost + 1):
            cost = _makespan(summary, resident) + _makespan(replay, resident) + combine
            if cost < gain * whole and cost <= best_cost:
                best, best_cost = length, cost
        length += MIN_SEGMENT_CHUNKS
    return best


def _makespan(programs: collections.Counter, slots: int) -> int:
    """Steps until the last of ``programs`` ({steps: how many programs}) ends when each starts,
    longest first, on whichever of ``slots`` frees first (list scheduling; the sm_90 scans dispatch
    whole varlen sequences longest first, ``_varlen_index``)."""
    free = [(0, slots)]                                  # (time a group of slots frees, how many)
    for steps in sorted(programs, reverse=True):
        left = programs[steps]
        while left > 0:
            t, n = heapq.heappop(free)
            take = min(n, left)
            heapq.heappush(free, (t + steps, take))
            if n > take:
                heapq.heappush(free, (t, n - take))
            left -= take
    return max(t for t, _ in free)


def _segment_key(p: Problem, counts: tuple[int, ...], length: int):
    return "segments", counts, length, LAST_SEGMENT_SUMMARIES, p.device


def _segment_plan(p: Problem, counts: tuple[int, ...], length: int):
    """(the segment table [segments, 4] int32: sequence, first chunk, chunks, is-last; each
    sequence's [first segment, segments] [N, 2] int32; the number of segments; the summary pass's
    table, the rows that are not last (all rows with LAST_SEGMENT_SUMMARIES); its row count). An
    empty sequence gets one empty segment, which carries its initial state to its final state."""
    def build():
        rows, per_seq = [], []
        for n, count in enumerate(counts):
            per_seq.append((len(rows), max(1, -(-count // length))))
            for c0 in range(0, max(count, 1), length):
                rows.append((n, c0, min(length, count - c0), int(c0 + length >= count)))
        summarized = rows if LAST_SEGMENT_SUMMARIES else [r for r in rows if not r[3]]
        return (torch.tensor(rows or [(0, 0, 0, 1)], dtype=torch.int32, device=p.device),
                torch.tensor(per_seq, dtype=torch.int32, device=p.device), len(rows),
                torch.tensor(summarized or [(0, 0, 0, 1)], dtype=torch.int32, device=p.device), len(summarized))
    return HOST_TABLES.get(_segment_key(p, counts, length), build, pin=_capturing(p))


def _segments(p: Problem, config: ChunkConfig, counts: tuple[int, ...]) -> int:
    """The segment length the scan runs with under ``config``, 0 for whole sequences."""
    BV = min(config.scan_block_v, max(16, next_pow2(p.V)))
    length = config.segment_chunks
    if length is None:
        length = segment_length(p.N * p.HV, cdiv(p.V, BV), cdiv(p.V + p.K, BV), counts,
                                sm_count(p.device))
    return length if length and max(counts, default=0) > length else 0


def _chunk_counts(p: Problem) -> tuple[int, ...]:
    """Chunks per sequence (cached per offsets: several launch decisions ask for them per call)."""
    if p.cu_seqlens_host is None:
        return (cdiv(p.T, BT),) * p.B
    return _varlen_chunk_counts(p.cu_seqlens_host)


@functools.lru_cache(maxsize=256)
def _varlen_chunk_counts(cu: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-(e - s) // BT) for s, e in zip(cu[:-1], cu[1:]))


def supports(p: Problem, config: ChunkConfig | None = None) -> str | None:
    """None when this tier serves ``p`` (under ``config``, default_config's when None), else why not."""
    from fastla.backends.triton import available

    reason = available(p.device)
    if reason:
        return reason
    if not p.delta:
        if p.gv is not None:
            return "per-value-channel gates (gv)"
    if p.chunk_size != BT:
        return f"chunk_size {p.chunk_size} (the Triton chunked forward uses {BT})"
    if p.K > 128 or p.V > 128:
        return "head dims above 128"
    if p.q.dtype == torch.float64:
        return "float64 inputs are served by the torch tier"
    if p.cu_seqlens is not None and p.cu_seqlens_host is None:
        return "needs the sequence offsets on the host (pass cu_seqlens_cpu)"
    if _capturing(p):
        if p.cu_seqlens_host is not None and not HOST_TABLES.cached(_varlen_key(p)):
            return "a first call with these cu_seqlens must come before CUDA-graph capture (it builds the chunk index)"
        counts = _chunk_counts(p)
        length = _segments(p, config or default_config(p), counts)
        if length and not HOST_TABLES.cached(_segment_key(p, counts, length)):
            return "a first call with this shape must come before CUDA-graph capture (it builds the segment table)"
    if p.needs_grad():
        return "inputs require grad (the forward kernels keep no autograd graph; chunk_training serves such calls)"
    return None


DENSE_FIELDS = ("q", "k", "v", "g", "gk", "g_gamma", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens")


def dense_inputs(p: Problem, align: int = 1, in_place: tuple[str, ...] = ()) -> Problem:
    """``p`` as the kernels read it: each tensor they read as a dense row-major array contiguous
    (and its address a multiple of ``align`` bytes: 16 for TMA): strided views (q, k, v split
    from one projection) and misaligned ones are copied (call_plan.dense: a plan replays the
    copies), the rest, and the fields named in ``in_place`` (which the caller's kernels read
    through their strides), passed as they are; and offsets given only as ``cu_seqlens_cpu`` on
    the device (the varlen index table's copy, built once per offsets)."""
    fields = {n: getattr(p, n) if n in in_place else call_plan.dense(getattr(p, n), align) for n in DENSE_FIELDS}
    changed = {n: x for n, x in fields.items() if x is not getattr(p, n)}
    if p.cu_seqlens is None and p.cu_seqlens_host is not None:
        changed["cu_seqlens"] = _varlen_index(p)[4]
    return dataclasses.replace(p, **changed) if changed else p


def piece_cuts(T: int, pieces: int) -> list[int]:
    """Token offsets cutting one sequence of T tokens into ``pieces`` runs of whole chunks (as equal
    as chunks allow; the last ends at T)."""
    NT = cdiv(T, BT)
    return [min(T, (i * NT // pieces) * BT) for i in range(pieces)] + [T]


def one_sequence(p: Problem) -> bool:
    """Whether ``p``'s batch rows are one sequence each: no offsets, or offsets ``[0, T]`` known on
    the host (a packed batch of one request)."""
    return p.cu_seqlens is None or p.cu_seqlens_host == (0, p.T)


def run_in_pieces(p: Problem, cuts: list[int], run_piece) -> tuple:
    """The forward of one sequence (B = 1, no offsets or offsets ``[0, T]``, which the pieces drop)
    as consecutive pieces ``[cuts[i], cuts[i + 1])``: ``run_piece(sub, out)`` runs the sub-problem ``sub`` (the piece's q, k, v, gate
    and beta views, its initial state the previous piece's final state, in fp32) writing ``out``
    (the piece's rows of the output) and returns run's ``(o, final state)``. The chunks' math is
    the whole call's, the state carried between pieces through memory in fp32 as the scans keep it:
    the same output and final state. Returns ``(o, final state)``."""
    if p.B != 1 or not one_sequence(p) or p.return_intermediate_states or p.pool is not None:
        raise ValueError("run_in_pieces: one sequence without chunk states or a state pool")
    o = call_plan.empty((1, p.T, p.HV, p.V), p.o_dtype, p.device)
    state = p.initial_state
    for i, (t0, t1) in enumerate(zip(cuts[:-1], cuts[1:])):
        last = i == len(cuts) - 2
        cut = {n: call_plan.note_view(getattr(p, n)[:, t0:t1], getattr(p, n))
               for n in ("q", "k", "v", "g", "gk", "gv", "beta") if getattr(p, n) is not None}
        sub = dataclasses.replace(p, **cut, T=t1 - t0, initial_state=state, cu_seqlens=None, cu_seqlens_host=None,
                                  output_final_state=p.output_final_state if last else True)
        _, state = run_piece(sub, call_plan.note_view(o[:, t0:t1], o))
    return o, state


@dataclass(frozen=True)
class SequencePass:
    """What a sequence pass of the scan (whole sequences, or segment replays) reads and writes,
    for a tier that brings its own scan kernel (backends/gluon) and reuses the rest of ``run``."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    beta_mode: int
    inverse: torch.Tensor
    scores: torch.Tensor
    rq: torch.Tensor
    rk: torch.Tensor
    gcum: torch.Tensor
    o: torch.Tensor
    h0: torch.Tensor | None
    ht: torch.Tensor | None
    h_chunks: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    chunk_start: torch.Tensor | None
    T: int
    NT: int
    dummy: torch.Tensor
    kd: torch.Tensor | None = None          # KDA (per-channel gates): q, k are qg, kg [B, T, HV, K]; kd
    decay: torch.Tensor | None = None       # and e^(G_last) [chunks, HV, K] for the GK step
    gates: bool = False                     # KDA with the gates formed in the scan: q, k raw, kd the gate's input
    beta_in_p: bool = False                 # P diag(beta) in ``inverse`` (run's beta_in_p): Y without beta


def run(p: Problem, config: ChunkConfig | None = None, sequence_scan=None, kda_prologue=None, summaries=False,
        gdn_scores=None, gdn_inverse=None, dense: bool = True, out: torch.Tensor | None = None,
        scores_in_scan: bool = False, gates_in_scan: bool = False, beta_in_p: bool = False):
    """The chunked forward. ``sequence_scan(p, SequencePass, seg, segments, seg_state, programs)``,
    when given, launches the sequence passes (seg 0 or 2; seg 0's ``segments`` are varlen's
    sequence orders, _varlen_index) instead of the Triton scan; it must
    write the output; with ``summaries`` it runs the segment summary pass too (seg 1: the V + K
    columns from [0 | I] of each segment that starts another, ``[summaries, HV, K, V + K]`` into
    seg_state). ``kda_prologue``, when
    given, runs KDA's prologue instead of chunk_prepare_kda.launch (same arguments less q, k and
    the launch shape); ``gdn_scores`` and ``gdn_inverse``, GDN's scores and inverse kernels instead
    of chunk_prepare.launch_scores and chunk_prepare.launch (same arguments and outputs).
    ``dense`` False: the caller has already passed ``p`` through dense_inputs for its kernels.
    ``out``: the output's buffer ([B, T, HV, V], contiguous, ``p.o_dtype``) instead of a new one.
    ``scores_in_scan`` (GDN with ``gdn_inverse`` and a ``sequence_scan`` that forms the scores,
    gluon/chunk_delta.scores_in_scan): no scores are written (SequencePass.scores is None), and
    ``gdn_inverse`` also writes 1 / |q| and 1 / |k| (its ``rq``, ``rk``). ``gates_in_scan`` (KDA's
    bounded gate with the caller's ``kda_prologue`` and a ``sequence_scan`` that gates the keys and
    queries itself, gluon/chunk_delta.gates_in_scan): the prologue writes no kg, kd nor qg, and the
    pass reads the raw q, k and the gate's input (SequencePass.gates). ``beta_in_p`` (with either):
    the caller's inverse kernel or prologue writes P diag(beta) instead of P (its ``beta_cols``),
    and the sequence scan reads it so (SequencePass.beta_in_p: its Y skips beta)."""
    if beta_in_p and not (scores_in_scan or gates_in_scan):
        raise ValueError("beta_in_p: with the scores or the gates formed in the caller's scan")
    if scores_in_scan and not (p.delta and p.gk is None and gdn_inverse is not None and sequence_scan is not None):
        raise ValueError("scores_in_scan: GDN with the caller's inverse kernel and sequence scan")
    if gates_in_scan and not (p.delta and p.gk is not None and kda_prologue is not None and sequence_scan is not None):
        raise ValueError("gates_in_scan: KDA with the caller's prologue and sequence scan")
    if dense:
        p = dense_inputs(p)
    config = config or default_config(p)
    B, T, H, HV, K, V, N = p.B, p.T, p.H, p.HV, p.K, p.V, p.N
    dev = p.device
    varlen = p.cu_seqlens is not None
    NT = cdiv(T, BT)
    if varlen:
        chunk_index, chunk_start, total, orders, _ = _varlen_index(p)
        cu = p.cu_seqlens
    else:
        total = B * NT
        chunk_index = chunk_start = cu = orders = None

    # bf16 products for bf16 inputs (as FLA), fp32 operands otherwise and always in the CPU
    # interpreter, whose bf16 products are wrong (Triton 3.6)
    bf16 = p.q.dtype == torch.bfloat16 and not interpreting()
    op_dtype = torch.bfloat16 if bf16 else torch.float32
    dot = tl.bfloat16 if bf16 else tl.float32
    scores = None if scores_in_scan else call_plan.empty((B, T, HV, BT), op_dtype, dev)
    if not p.delta:
        # the plain rule reads neither beta nor P: the scores stand in for both (the sm_90 scans
        # load beta's rows, in bounds, and leave them unused)
        beta, beta_mode, inverse = scores, BETA_GIVEN, scores
    else:
        if p.beta is None:
            beta, beta_mode = call_plan.full((B, T, HV), 1.0, torch.float32, dev), BETA_GIVEN
        else:
            beta = p.beta
            beta_mode = (BETA_SIGMOID2 if p.allow_neg_eigval else BETA_SIGMOID) if p.beta_sigmoid else BETA_GIVEN
        inverse = call_plan.empty((B, T, HV, BT), op_dtype, dev)
    BK, BVF = max(16, next_pow2(K)), max(16, next_pow2(V))   # tl.dot needs >= 16
    tables = (cu, chunk_index) if varlen else (None, None)
    channel_gate = p.gk is not None
    if channel_gate:
        # KDA: the scan reads the gated queries and keys of the prologue (per value head); GLA (the
        # plain rule) reads no gated keys
        decay = call_plan.empty((max(total, 1), HV, K), torch.float32, dev)
        if gates_in_scan:
            q, k, kd = p.q, p.k, p.gk           # (gated in the scan)
        else:
            q, kd = (call_plan.empty((B, T, HV, K), op_dtype, dev) for _ in range(2))
            k = call_plan.empty((B, T, HV, K), op_dtype, dev) if p.delta else decay
        gcum = rq = rk = None
        if gates_in_scan and p.use_qk_l2norm:         # (the prologue's norms: the scan weights by them)
            rq, rk = (call_plan.empty((B, T, H), torch.float32, dev) for _ in range(2))
        dummy = decay
        if total and gates_in_scan:
            kda_prologue(p, beta, beta_mode, total, tables, inverse, scores, None, None, None, decay, rq=rq, rk=rk,
                         beta_cols=beta_in_p)
        elif total and kda_prologue is not None:
            kda_prologue(p, beta, beta_mode, total, tables, inverse, scores, k, kd, q, decay)
        elif total:
            chunk_prepare_kda.launch(p, p.q, p.k, beta, beta_mode, total, tables, inverse, scores, k, kd, q, decay,
                                     dot, config.kda_prepare_block_k, config.kda_prepare_warps,
                                     config.kda_prepare_maxnreg)
    else:
        gcum = call_plan.empty((B, T, HV), torch.float32, dev)
        # 1 / |q| and 1 / |k| only with the l2norm in the op (the kernels read them under L2NORM)
        rq, rk = ((call_plan.empty((B, T, H), torch.float32, dev) for _ in range(2)) if p.use_qk_l2norm
                  else (None, None))
        dummy = gcum
        kd = decay = None
        q, k = (p.q, p.k) if p.q.dtype == op_dtype or bf16 else (p.q.to(op_dtype), p.k.to(op_dtype))
        if total and p.delta:
            g = p.g if p.g is not None else call_plan.full((B, T, HV), 0.0, torch.float32, dev)
            if scores_in_scan:
                gdn_inverse(p, g, beta, beta_mode, total, tables, gcum, inverse, dot, config, rq=rq, rk=rk,
                            beta_cols=beta_in_p)
            else:
                (gdn_inverse or chunk_prepare.launch)(p, g, beta, beta_mode, total, tables, gcum, inverse, dot, config)
        elif total:
            chunk_prepare.launch_gate_cumsum(p, total, tables, gcum)          # G of the plain rule's gate
        if total and not scores_in_scan:
            (gdn_scores or chunk_prepare.launch_scores)(p, q, k, total, tables, gcum, scores, rq, rk, dot, config)

    o = out if out is not None else call_plan.empty((B, T, HV, V), p.o_dtype, dev)
    state_shape = (HV, V, K) if p.state_v_first else (HV, K, V)
    SK, SV = (1, K) if p.state_v_first else (V, 1)
    ht = call_plan.empty((N, *state_shape), torch.float32, dev) if p.output_final_state else None
    store_states = p.return_intermediate_states
    h_chunks = call_plan.empty((total, *state_shape), p.k.dtype, dev) if store_states else dummy
    BV = min(config.scan_block_v, BVF)
    h0 = p.initial_state
    counts = _chunk_counts(p)
    length = _segments(p, config, counts)
    if gates_in_scan and (length or store_states):
        raise RuntimeError("gates_in_scan: whole sequences without chunk states only")
    common = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, SK=SK, SV=SV, DOT=dot, HAS_H0=h0 is not None,
                  STORE_FINAL=ht is not None, L2NORM=p.use_qk_l2norm and not channel_gate, VARLEN=varlen,
                  BETA=beta_mode, GK=channel_gate, DELTA=p.delta,
                  num_warps=config.scan_warps, num_stages=config.scan_stages)
    if rq is None:
        rq = rk = dummy
    args = (q, k, p.v, beta, inverse, scores if scores is not None else dummy, rq, rk, gcum if gcum is not None else dummy,
            kd if kd is not None else dummy, decay if decay is not None else dummy, o,
            h0 if h0 is not None else o, ht if ht is not None else o, h_chunks,
            cu if varlen else dummy, chunk_start if varlen else dummy)
    if sequence_scan is not None:
        seq_pass = SequencePass(q, k, p.v, beta, beta_mode, inverse, scores, rq, rk, gcum, o, h0, ht,
                                h_chunks if store_states else None, cu if varlen else None,
                                chunk_start if varlen else None, T, NT, dummy, kd, decay, gates_in_scan, beta_in_p)
    if length:
        segments, seq_segments, n_seg, summarized, n_sum = _segment_plan(p, counts, length)
        summary = call_plan.empty((n_sum, HV, K, V + K), torch.float32, dev)
        seg_start = call_plan.empty((n_seg, HV, K, V), torch.float32, dev)
        if summaries and sequence_scan is not None:
            sequence_scan(p, seq_pass, 1, summarized, summary, n_sum)
        else:
            launcher(_scan_kernel, T, NT)[(n_sum * HV, cdiv(V + K, BV))](*args, summarized, summary, T, NT, p.scale,
                                                                 BV=BV, SEG=1, STORE_STATES=False, **common)
        BVC = min(config.combine_block_v, BVF)
        launcher(_segment_combine_kernel)[(N * HV, cdiv(V, BVC))](
            summary, seg_start, h0 if h0 is not None else o, seq_segments, HV=HV, K=K, V=V, BK=BK, BV=BVC,
            SK=SK, SV=SV, HAS_H0=h0 is not None, ALL_SUMMARIES=LAST_SEGMENT_SUMMARIES,
            num_warps=config.combine_warps, num_stages=config.combine_stages)
        if sequence_scan is not None:
            sequence_scan(p, seq_pass, 2, segments, seg_start, n_seg)
        else:
            launcher(_scan_kernel, T, NT)[(n_seg * HV, cdiv(V, BV))](*args, segments, seg_start, T, NT, p.scale, BV=BV, SEG=2,
                                                             STORE_STATES=store_states, **common)
    elif sequence_scan is not None:
        sequence_scan(p, seq_pass, 0, orders if varlen else dummy, dummy, N)
    else:
        launcher(_scan_kernel, T, NT)[(N * HV, cdiv(V, BV))](*args, dummy, dummy, T, NT, p.scale, BV=BV, SEG=0,
                                                     STORE_STATES=store_states, **common)
    if p.return_intermediate_states:
        h = h_chunks[None] if varlen else h_chunks.view(B, NT, *state_shape)
        return o, ht, h
    return o, ht
