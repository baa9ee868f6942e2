"""``chunk_gla``: Gated Linear Attention prefill / training (FLA 0.6.0's API).

Per head: ``S = Diag(exp(g_t)) S + k_t v_t^T; o_t = scale * S^T q_t``.
"""
from __future__ import annotations

import torch

from fastla.core import call_plan
from fastla.core.custom_ops import run_chunk
from fastla.core.validation import resolve_state_layout


@call_plan.planned
def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: int | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    transpose_state_layout: bool | None = None,
):
    r"""Chunked GLA.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: per-key log decay ``[B, T, H, K]``.
        scale: defaults to ``K ** -0.5``. initial_state: ``[N, H, K, V]`` (V-first with
        ``state_v_first``). cu_seqlens / cu_seqlens_cpu: packed offsets (``B == 1``).

    Returns:
        ``(o [B, T, H, V], final_state or None)``.
    """
    state_v_first = resolve_state_layout(state_v_first, transpose_state_layout)
    return run_chunk(
        "chunk_gla", q=q, k=k, v=v, gk=g, delta=False, gva=False, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        output_like="v",
    )

