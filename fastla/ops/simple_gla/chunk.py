"""``chunk_simple_gla``: Simple GLA (scalar per-head decay) prefill / training (FLA 0.6.0's API).

Per head: ``S = exp(g_t) S + k_t v_t^T; o_t = scale * S^T q_t``, with ``g`` per token
``[B, T, H]`` and / or the constant ``g_gamma [H]`` (both given: their sum).
"""
from __future__ import annotations

import torch

from fastla.core import call_plan
from fastla.core.custom_ops import run_chunk
from fastla.core.validation import check_chunk_size, reject_head_first, resolve_state_layout


@call_plan.planned
def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    chunk_size: int | None = None,
    transpose_state_layout: bool | None = None,
    head_first: bool = False,
):
    r"""Chunked Simple GLA.

    Args:
        g: log decay ``[B, T, H]``; g_gamma: constant log decay ``[H]``; neither: no decay.
        chunk_size: a power of two (default 64). Other arguments as ``chunk_gla``.

    Returns:
        ``(o [B, T, H, V], final_state or None)``.
    """
    state_v_first = resolve_state_layout(state_v_first, transpose_state_layout)
    reject_head_first(head_first)
    chunk_size = check_chunk_size(chunk_size, None)
    return run_chunk(
        "chunk_simple_gla", q=q, k=k, v=v, g=g, g_gamma=g_gamma, delta=False, gva=False, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size,
    )

