"""``naive_recurrent_kda``: the token-by-token KDA reference (float64 by default)."""
from __future__ import annotations

import torch

from fastla.core.reference import reference_for
from fastla.core.validation import build_problem


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
):
    """Same options as ``chunk_kda`` (keyword-only); returns ``(o, final_state)`` in ``dtype``."""
    problem = build_problem(
        "naive_recurrent_kda", q=q, k=k, v=v, gk=g, beta=beta, delta=True, gva=True,
        gate_in_op="kda" if use_gate_in_kernel else None, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound if use_gate_in_kernel else None, safe_gate=safe_gate,
        use_qk_l2norm=use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )
    return reference_for(problem, dtype)
