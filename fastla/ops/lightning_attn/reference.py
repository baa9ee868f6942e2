"""``naive_recurrent_lightning_attn``: the token-by-token Lightning reference (float64 by default)."""
from __future__ import annotations

import torch

from fastla.core.gates import lightning_g_gamma
from fastla.core.validation import check_lightning_layers
from fastla.ops.simple_gla.reference import naive_recurrent_simple_gla


def naive_recurrent_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
):
    """Same options as ``chunk_lightning_attn`` (keyword-only); returns ``(o, final_state)`` in ``dtype``."""
    check_lightning_layers(layer_idx, num_layers)
    return naive_recurrent_simple_gla(
        q, k, v, g_gamma=lightning_g_gamma(q.shape[2], layer_idx, num_layers, q.device), scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, reverse=reverse,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, dtype=dtype,
    )
