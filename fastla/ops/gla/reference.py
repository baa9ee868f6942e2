"""``naive_recurrent_gla``: the token-by-token GLA reference (float64 by default)."""
from __future__ import annotations

import torch

from fastla.core.reference import reference_for
from fastla.core.validation import build_problem


def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
):
    """Same options as ``chunk_gla`` / ``fused_recurrent_gla`` (keyword-only; ``g`` is the per-key gate)."""
    problem = build_problem(
        "naive_recurrent_gla", q=q, k=k, v=v, gk=g, gv=gv, delta=False, gva=False, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, reverse=reverse,
    )
    return reference_for(problem, dtype)
