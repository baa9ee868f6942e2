"""``fused_chunk_simple_gla``: FLA 0.6.0's second chunked entry point for Simple GLA.

The same function as ``chunk_simple_gla`` with FLA's shorter signature (no ``state_v_first`` nor
``cu_seqlens_cpu`` among the positional arguments); it runs the same tiers.
"""
from __future__ import annotations

import torch

from fastla.ops.simple_gla.chunk import chunk_simple_gla


def fused_chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    state_v_first: bool = False,
):
    r"""Chunked Simple GLA, as ``chunk_simple_gla``.

    Returns:
        ``(o [B, T, H, V], final_state or None)``.
    """
    return chunk_simple_gla(q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, state_v_first=state_v_first,
                            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
