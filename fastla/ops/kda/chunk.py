"""``chunk_kda``: Kimi Delta Attention prefill / training (FLA 0.6.0's API).

Per value head: ``S = Diag(exp(g_t)) S; u = beta_t (v_t - S^T k_t); S += k_t u^T;
o_t = scale * S^T q_t`` with a per-key-channel gate ``g_t``.
"""
from __future__ import annotations

import torch

from fastla.core import call_plan
from fastla.core.custom_ops import run_chunk
from fastla.core.validation import (
    check_chunk_size, reject_cp_context, reject_head_first, resolve_state_layout,
)


@call_plan.planned
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    transpose_state_layout: bool | None = None,
    head_first: bool = False,
):
    r"""Chunked KDA.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (GVA: ``HV`` a multiple of ``H``).
        g: per-channel log decay ``[B, T, HV, K]``, or the raw gate input with
            ``use_gate_in_kernel=True``: ``-exp(A_log) * softplus(g + dt_bias)``, or with
            ``lower_bound`` set ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
            (``A_log [HV]`` optional then; ``dt_bias [HV * K]``).
        beta: ``[B, T, HV]`` (logits with ``use_beta_sigmoid_in_kernel``).
        safe_gate: gates bounded below by ``lower_bound`` in ``[-5, 0)`` (required with the
            gate in the op); lets GPU tiers use tensor cores. The torch tier is exact either way.
        disable_recompute: a memory/speed trade-off of FLA's backward; no effect on results.
        return_intermediate_states: also return chunk-start states ``[B, NT, HV, K, V]``.
        use_graph / max_num_seqs: FLA's CUDA-graph varlen mode; ``cu_seqlens`` must then have
            ``max_num_seqs + 1`` entries (zero-length tail sequences allowed).
        Other arguments as ``chunk_gated_delta_rule``.

    Returns:
        ``(o, final_state)`` or ``(o, final_state, h)``.
    """
    state_v_first = resolve_state_layout(state_v_first, transpose_state_layout)
    reject_head_first(head_first)
    reject_cp_context(cp_context)
    chunk_size = check_chunk_size(chunk_size, (32, 64))
    if use_graph and cu_seqlens is not None and max_num_seqs is not None and cu_seqlens.shape[0] - 1 != max_num_seqs:
        raise ValueError(
            f"use_graph=True needs cu_seqlens padded to max_num_seqs + 1 = {max_num_seqs + 1} entries, "
            f"got {cu_seqlens.shape[0]}"
        )
    return run_chunk(
        "chunk_kda", q=q, k=k, v=v, gk=g, beta=beta, delta=True, gva=True,
        gate_in_op="kda" if use_gate_in_kernel else None, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound if use_gate_in_kernel else None, safe_gate=safe_gate,
        use_qk_l2norm=use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size, return_intermediate_states=return_intermediate_states,
    )

