"""``chunk_lightning_attn``: Lightning Attention (MiniMax) prefill / training (FLA 0.6.0's API).

Simple GLA with the constant per-head decay
``g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h``.
"""
from __future__ import annotations

import torch

from fastla.core import call_plan
from fastla.core.custom_ops import run_chunk
from fastla.core.gates import lightning_g_gamma
from fastla.core.validation import (
    check_chunk_size, check_lightning_layers, reject_head_first, resolve_state_layout,
)


@call_plan.planned
def chunk_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    state_v_first: bool = False,
    chunk_size: int | None = None,
    transpose_state_layout: bool | None = None,
    head_first: bool = False,
):
    r"""Chunked Lightning Attention. ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``; the decay
    comes from ``layer_idx`` and ``num_layers``. Returns ``(o, final_state or None)``."""
    state_v_first = resolve_state_layout(state_v_first, transpose_state_layout)
    reject_head_first(head_first)
    check_lightning_layers(layer_idx, num_layers)
    chunk_size = check_chunk_size(chunk_size, None)
    g_gamma = lightning_g_gamma(q.shape[2], layer_idx, num_layers, q.device)
    return run_chunk(
        "chunk_lightning_attn", q=q, k=k, v=v, g_gamma=g_gamma, delta=False, gva=False, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size,
    )

