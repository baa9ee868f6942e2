"""``fused_recurrent_kda``: KDA decode (FLA 0.6.0's API, plus the serving pool keywords)."""
from __future__ import annotations

import torch

from fastla.core import call_plan
from fastla.core.custom_ops import run_recurrent
from fastla.core.validation import resolve_state_layout


@call_plan.planned
def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    disable_state_update: bool = False,
    transpose_state_layout: bool | None = None,
):
    r"""Token-by-token KDA. Arguments as ``chunk_kda``; the serving keywords as
    ``fused_recurrent_gated_delta_rule`` (``ssm_state_indices``, ``num_accepted_tokens``,
    ``disable_state_update``). ``lower_bound`` applies to the gate computed in the op.

    Returns:
        ``(o [B, T, HV, V], final_state)``; with a pool, ``final_state`` is the pool.
    """
    state_v_first = resolve_state_layout(state_v_first, transpose_state_layout)
    return run_recurrent(
        "fused_recurrent_kda", q=q, k=k, v=v, gk=g, beta=beta, delta=True, gva=True,
        gate_in_op="kda" if use_gate_in_kernel else None, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound if use_gate_in_kernel else None,
        use_qk_l2norm=use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, ssm_state_indices=ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens, disable_state_update=disable_state_update,
        output_like="v",
    )
