"""``fused_recurrent_gated_delta_rule``: Gated DeltaNet decode (FLA 0.6.0's API, plus serving).

Beyond FLA's arguments it takes the serving keywords of a state pool updated in place:
``ssm_state_indices`` (``[N]`` or ``[N, T]``; negative skips a row), ``num_accepted_tokens``
and ``disable_state_update``.
"""
from __future__ import annotations

import torch

from fastla.core import call_plan
from fastla.core.custom_ops import run_recurrent
from fastla.core.validation import resolve_state_layout


@call_plan.planned
def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    disable_state_update: bool = False,
    transpose_state_layout: bool | None = None,
):
    r"""Token-by-token gated delta rule.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``.
        g: scalar log decay ``[B, T, HV]`` (raw gate input with ``use_gate_in_kernel``);
        gk: per-key log decay ``[B, T, HV, K]``; gv: per-value log decay ``[B, T, HV, V]``.
        beta: ``[B, T, HV]`` (``None``: 1).
        initial_state: ``[N, HV, K, V]`` (V-first with ``state_v_first``), or with
            ``ssm_state_indices`` the pool ``[slots, HV, K, V]`` updated in place.
        ssm_state_indices: slot of each sequence ``[N]``, or of each token ``[N, T]`` (the
            state after token t is written to ``[n, t]``); negative: skip (zero output).
        num_accepted_tokens: ``[N]``, start from slot ``ssm_state_indices[n, a_n - 1]``.
        disable_state_update: read the pool, never write it (draft verification).

    Returns:
        ``(o [B, T, HV, V], final_state)``; with a pool, ``final_state`` is the pool.
    """
    state_v_first = resolve_state_layout(state_v_first, transpose_state_layout)
    if use_gate_in_kernel and g is None:
        raise ValueError("g (the raw gate input) must be given when use_gate_in_kernel=True")
    return run_recurrent(
        "fused_recurrent_gated_delta_rule", q=q, k=k, v=v, g=g, gk=gk, gv=gv, beta=beta, delta=True, gva=True,
        gate_in_op="gdn" if use_gate_in_kernel else None, A_log=A_log, dt_bias=dt_bias,
        use_qk_l2norm=use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, ssm_state_indices=ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens, disable_state_update=disable_state_update,
        output_like="v",
    )


fused_recurrent_gdn = fused_recurrent_gated_delta_rule
