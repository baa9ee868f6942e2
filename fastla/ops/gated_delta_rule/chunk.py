"""``chunk_gated_delta_rule``: Gated DeltaNet prefill / training (FLA 0.6.0's API).

Per value head: ``S = exp(g_t) S; u = beta_t (v_t - S^T k_t); S += k_t u^T;
o_t = scale * S^T q_t``. Validation builds a Problem; the dispatcher picks the tier.
"""
from __future__ import annotations

import torch

from fastla.core import call_plan
from fastla.core.custom_ops import run_chunk
from fastla.core.validation import (
    check_chunk_indices, check_chunk_size, reject_cp_context, reject_head_first, resolve_state_layout,
)


@call_plan.planned
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    return_intermediate_states: bool = False,
    transpose_state_layout: bool | None = None,
    head_first: bool = False,
):
    r"""Chunked gated delta rule.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]`` with ``HV`` a multiple of ``H`` (GVA).
        g: log decay ``[B, T, HV]``; the raw gate input when ``use_gate_in_kernel=True``
            (then ``g = -exp(A_log) * softplus(g + dt_bias)``, ``A_log, dt_bias: [HV]``).
        beta: ``[B, T, HV]``; logits when ``use_beta_sigmoid_in_kernel=True`` (``2 * sigmoid``
            with ``allow_neg_eigval=True``).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first=True``).
        output_final_state: also return the final state (float32, same layout).
        use_qk_l2norm_in_kernel: l2-normalise q and k in the op.
        cu_seqlens / cu_seqlens_cpu: ``[N+1]`` packed offsets (``B == 1``); the CPU copy
            avoids a device-to-host sync.
        chunk_indices: FLA's precomputed chunk index ``[num_chunks, 2]``; checked, then
            recomputed internally. cp_context: not supported (NotImplementedError).
        chunk_size: 16, 32 or 64.
        return_intermediate_states: also return the state at the start of every chunk,
            ``[B, NT, HV, K, V]`` (varlen: ``[1, total chunks, ...]``) in k's dtype.

    Returns:
        ``(o [B, T, HV, V], final_state or None)``, plus ``h`` when
        ``return_intermediate_states=True``.
    """
    state_v_first = resolve_state_layout(state_v_first, transpose_state_layout)
    reject_head_first(head_first)
    reject_cp_context(cp_context)
    chunk_size = check_chunk_size(chunk_size, (16, 32, 64))
    return run_chunk(
        "chunk_gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta, delta=True, gva=True,
        gate_in_op="gdn" if use_gate_in_kernel else None, A_log=A_log, dt_bias=dt_bias,
        use_qk_l2norm=use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size, return_intermediate_states=return_intermediate_states,
        check=None if chunk_indices is None else lambda p: check_chunk_indices(chunk_indices, p),
    )


chunk_gdn = chunk_gated_delta_rule
