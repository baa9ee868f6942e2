"""Chunk and sequence lookups shared by the Triton chunked kernels (jit helpers).

Dense batches need no index tensors: sequence ``n`` is batch row ``n`` with ``NT`` chunks of
``BT`` tokens. Varlen batches read ``cu_seqlens`` and host-built tables: ``chunk_index``
``[chunks, 2]`` (sequence, chunk within it) and ``chunk_start`` ``[N]`` (first global chunk).
"""
from __future__ import annotations

import triton
import triton.language as tl

BT = 64     # tokens per chunk


@triton.jit
def _sequence(cu_seqlens, chunk_start, i_n, T, NT, VARLEN: tl.constexpr):
    """Sequence i_n's token range [bos, eos) in the packed batch and the global index of its first
    chunk (int64); dense batches: sequence i_n is batch row i_n."""
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        first_chunk = tl.load(chunk_start + i_n).to(tl.int64)
    else:
        bos = i_n * T
        eos = bos + T
        first_chunk = i_n * NT
    return bos, eos, first_chunk


@triton.jit
def _chunk(chunk_index, cu_seqlens, i_c, T, NT, VARLEN: tl.constexpr):
    """Global chunk i_c (int64) -> its sequence, its index there, and the sequence's [bos, eos)."""
    if VARLEN:
        i_n = tl.load(chunk_index + 2 * i_c).to(tl.int64)
        c = tl.load(chunk_index + 2 * i_c + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        i_n = i_c // NT
        c = i_c % NT
        bos = i_n * T
        eos = bos + T
    return i_n, c, bos, eos
