"""``fused_recurrent_gla``: GLA decode (FLA 0.6.0's API, plus the serving pool keywords)."""
from __future__ import annotations

import torch

from fastla.core import call_plan
from fastla.core.custom_ops import run_recurrent
from fastla.core.validation import resolve_state_layout


@call_plan.planned
def fused_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: int | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    disable_state_update: bool = False,
    transpose_state_layout: bool | None = None,
):
    r"""Token-by-token GLA.

    Args:
        gk: per-key log decay ``[B, T, H, K]``; gv: per-value log decay ``[B, T, H, V]``.
        reverse: run each sequence from its last token to its first.
        Serving keywords as ``fused_recurrent_gated_delta_rule``.

    Returns:
        ``(o [B, T, H, V], final_state)``; with a pool, ``final_state`` is the pool.
    """
    state_v_first = resolve_state_layout(state_v_first, transpose_state_layout)
    return run_recurrent(
        "fused_recurrent_gla", q=q, k=k, v=v, gk=gk, gv=gv, delta=False, gva=False, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, reverse=reverse,
        ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
        disable_state_update=disable_state_update,
    )
