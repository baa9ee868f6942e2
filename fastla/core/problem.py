"""``Problem``: one validated call of a public op, as every tier receives it.

The public functions (``fastla/ops/*``) validate their arguments once
(:mod:`fastla.core.validation`) and hand a ``Problem`` to the dispatcher; tiers read
the shapes and options from it and never re-validate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pool:
    """Serving state pool for the recurrent ops (in place).

    ``indices`` is ``[N]`` (one slot per sequence) or ``[N, T_max]`` (a slot per token:
    the state after token ``t`` of sequence ``n`` goes to ``indices[n, t]``). A negative
    index skips: that sequence's output is zero and no slot is read or written.
    ``num_accepted_tokens[n]`` (with 2-D indices) picks the start state
    ``indices[n, num_accepted_tokens[n] - 1]``; otherwise the start is column 0.
    """

    indices: torch.Tensor
    num_accepted_tokens: torch.Tensor | None
    disable_state_update: bool


@dataclass(frozen=True)
class Problem:
    op: str                              # public name, e.g. "chunk_kda"
    q: torch.Tensor                      # [B, T, H, K]
    k: torch.Tensor                      # [B, T, H, K]
    v: torch.Tensor                      # [B, T, HV, V]
    g: torch.Tensor | None               # [B, T, HV] scalar log decay (raw when gate_in_op == "gdn")
    gk: torch.Tensor | None              # [B, T, HV, K] per-key log decay (raw when gate_in_op == "kda")
    gv: torch.Tensor | None              # [B, T, HV, V] per-value log decay
    g_gamma: torch.Tensor | None         # [H] constant per-head log decay
    beta: torch.Tensor | None            # [B, T, HV]; None with delta=True means beta = 1
    delta: bool                          # delta rule (GDN, KDA) or plain rule (GLA family)
    gate_in_op: str | None               # None | "gdn" | "kda"
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    lower_bound: float | None
    use_qk_l2norm: bool
    beta_sigmoid: bool
    allow_neg_eigval: bool
    scale: float
    initial_state: torch.Tensor | None   # [N, HV, K, V] (V-first: [N, HV, V, K]) or the pool
    output_final_state: bool
    state_v_first: bool
    cu_seqlens: torch.Tensor | None
    cu_seqlens_host: tuple[int, ...] | None
    reverse: bool
    chunk_size: int
    return_intermediate_states: bool
    pool: Pool | None
    o_dtype: torch.dtype                 # FLA's output dtype for this op (q's or v's)
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int

    @property
    def device(self) -> torch.device:
        return self.q.device

    def needs_grad(self) -> bool:
        """Whether autograd is on and any input tensor (gates' parameters included) requires grad."""
        return torch.is_grad_enabled() and any(
            x is not None and x.requires_grad
            for x in (self.q, self.k, self.v, self.g, self.gk, self.gv, self.g_gamma, self.beta, self.initial_state,
                      self.A_log, self.dt_bias))
