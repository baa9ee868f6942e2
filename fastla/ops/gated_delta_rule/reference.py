"""GDN references: ``naive_recurrent_gated_delta_rule`` (token by token, float64 by default) and
``naive_chunk_gated_delta_rule`` (the chunked algorithm in fp32), with FLA 0.6.0's positional
arguments."""
from __future__ import annotations

import torch

from fastla.core.dispatch import use_tier
from fastla.core.reference import reference_for
from fastla.core.validation import build_problem
from fastla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
):
    """FLA's positional arguments (beta before g), then the options of ``chunk_gated_delta_rule``
    (keyword-only); returns ``(o, final_state)`` in ``dtype``."""
    problem = build_problem(
        "naive_recurrent_gated_delta_rule", q=q, k=k, v=v, g=g, gk=gk, gv=gv, beta=beta, delta=True, gva=True,
        gate_in_op="gdn" if use_gate_in_kernel else None, A_log=A_log, dt_bias=dt_bias,
        use_qk_l2norm=use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )
    return reference_for(problem, dtype)


def naive_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
):
    """FLA's chunked GDN reference (its arguments, g before beta): the torch tier's chunked
    algorithm in fp32 at ``chunk_size`` (16, 32 or 64), any device. Returns ``(o [B, T, HV, V],
    final_state [N, HV, K, V] or None)`` in fp32."""
    def fp32(x):
        return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    with use_tier("torch", strict=True):
        return chunk_gated_delta_rule(fp32(q), fp32(k), fp32(v), g=fp32(g), beta=fp32(beta), scale=scale,
                                      initial_state=fp32(initial_state), output_final_state=output_final_state,
                                      chunk_size=chunk_size)
