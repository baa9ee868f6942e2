"""``fused_recurrent_lightning_attn``: Lightning Attention decode (FLA 0.6.0's API, plus serving)."""
from __future__ import annotations

import torch

from fastla.core import call_plan
from fastla.core.custom_ops import run_recurrent
from fastla.core.gates import lightning_g_gamma
from fastla.core.validation import check_lightning_layers, resolve_state_layout


@call_plan.planned
def fused_recurrent_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    state_v_first: bool = False,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    disable_state_update: bool = False,
    transpose_state_layout: bool | None = None,
):
    r"""Token-by-token Lightning Attention. Arguments as ``chunk_lightning_attn``,
    ``reverse`` and the serving keywords as ``fused_recurrent_gla``."""
    state_v_first = resolve_state_layout(state_v_first, transpose_state_layout)
    check_lightning_layers(layer_idx, num_layers)
    g_gamma = lightning_g_gamma(q.shape[2], layer_idx, num_layers, q.device)
    return run_recurrent(
        "fused_recurrent_lightning_attn", q=q, k=k, v=v, g_gamma=g_gamma, delta=False, gva=False, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, reverse=reverse,
        ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
        disable_state_update=disable_state_update,
    )
