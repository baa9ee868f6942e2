"""Training on the kernel tiers for the chunked ops (GDN, KDA, GLA, Simple GLA, Lightning): the
forward on the fastest tier, the backward in Triton (chunk_delta_backward.py for scalar gates,
chunk_channel_backward.py for per-channel ones).

A chunked call that needs gradients is served here (the Triton tier's entry for the chunked ops,
``tier.py``): the gate computed in the op (GDN's, KDA's with or without lower_bound, Simple GLA's
and Lightning's constant ``g_gamma`` added to ``g``), the beta sigmoid and the state layout are
applied in PyTorch (autograd takes their gradients; ``[B, T, HV]``-sized but for KDA's gate and the
state; KDA's gate by gate_grads.py's two kernels instead, ``FUSED_KDA_GATE``, on), then
``ChunkTraining`` runs the forward through the dispatcher without gradients (the sm_90 kernels on
Hopper, the Triton ones elsewhere; the q/k l2norm in them) and its backward in
``chunk_delta_backward.py`` or ``chunk_channel_backward.py``, the q/k ends (the l2norm, GVA's sum
over value heads, the inputs' dtype) in ``qk_grads.py``. Calls it cannot serve (say why in
``reason``) go to the torch tier, which differentiates through PyTorch.

On by default for GDN and KDA (``ENABLED``; ``FASTLA_TRITON_BACKWARD=1`` every chunked op, ``0``
none): the kernels match the float64 reference in the CPU interpreter, and on an H100 their GPU
cases pass (fp32 at K = V = 32; bf16 at K = V = 128 dense and varlen, 16 and 64 dense) with the
reverse scan assembled by ptxas 12.9 (``launch.newer_ptxas``: CUDA 12.8's built its wgmma
descriptors from a wrong register). GDN fwd + bwd at B1 T8192 H16 HV32 on an H100: 2.41 ms of
kernels against FLA's 2.54 in one process (benchmarks/backward_profile.py; 5.1 ms before the q/k
ends moved into qk_grads and the scan onto bf16 operands, 3.0 before the launch shapes of
chunk_delta_backward and the state terms of dG moved to the key kernel), eager (at 3.0 ms of
kernels) 3.05 ms against FLA's 3.94 in one process (``python -m fastla bench --modes fwdbwd``);
KDA's at B1 T8192 H64 11.8 ms of kernels, 3.1 of them the score-gradient kernel's (22.8 and 12.2
before its diagonal blocks went on products, 13.75 before FUSED_KDA_GATE; FLA not compared). None of it has run on an H200.
On an H100 the training fuzz (tests/ops/test_option_fuzz.py) found two faults of the value-gradient
kernel (chunk_channel_backward.py): KDA at K = 64, V = 32 faulted under CUDA 12.8's ptxas, and
GLA's dq was wrong at K = V = 64, ptxas having dropped the kernel's products
(tests/backends/test_triton_sm90.py now checks every product reaches the SASS). Both go away with
the kernel's tiles that passed there (``chunk_channel_backward.value_block``). The plain rule stays
behind the switch until its GPU cases have run with them (docs/notes/chunk-backward.md).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from fastla.backends.triton import (
    chunk_channel_backward, chunk_delta, chunk_delta_backward, gate_grads, launch, qk_grads,
)
from fastla.core import dispatch
from fastla.core.gates import beta_activation, gdn_gate, kda_gate
from fastla.core.problem import Problem

# Which ops train here: True every one, False none, or a tuple of op names. By default the ops whose
# GPU cases pass (GDN and KDA on an H100, the module's docstring); FASTLA_TRITON_BACKWARD=1 every
# chunked op, 0 none
_SWITCH = os.environ.get("FASTLA_TRITON_BACKWARD")
ENABLED = True if _SWITCH == "1" else False if _SWITCH == "0" else ("chunk_gated_delta_rule", "chunk_kda")
# The forward keeps its chunk-start states for the backward (False: the backward recomputes them)
SAVE_STATES = True
# KDA's gate computed in the op by gate_grads' two Triton kernels instead of PyTorch's chain (its
# GPU cases pass on an H100; KDA's fwd + bwd at B1 T8192 H64 13.75 -> 11.79 ms of kernels:
# docs/notes/chunk-backward.md); False: PyTorch's chain (core.gates.kda_gate)
FUSED_KDA_GATE = True

OPS = ("chunk_gated_delta_rule", "chunk_kda", "chunk_gla", "chunk_simple_gla", "chunk_lightning_attn")


def reason(p: Problem) -> str | None:
    """None when this path serves ``p`` (a call that needs gradients), else why not."""
    if p.op not in OPS:
        return "inputs require grad: no Triton backward for this op (the torch tier has autograd)"
    if not (ENABLED is True or (ENABLED is not False and p.op in ENABLED)):
        return (f"inputs require grad: the Triton backward of {p.op} is off until it passes its GPU tests "
                "(FASTLA_TRITON_BACKWARD=1 turns it on; the torch tier has autograd)")
    if p.q.is_cuda and torch.cuda.get_device_capability(p.q.device) == (9, 0) and launch.sm90_ptxas() is None:
        return ("inputs require grad: the Triton backward's reverse scan needs ptxas %d.%d or newer on sm_90 "
                "(CUDA 12.8's builds it wrong; TRITON_PTXAS_PATH names one); the torch tier has autograd"
                % launch.FIXED_PTXAS)
    if p.return_intermediate_states:
        return "inputs require grad with return_intermediate_states (the torch tier differentiates them)"
    with torch.no_grad():
        return chunk_delta.supports(p)


def supports(p: Problem) -> str | None:
    """The Triton tier's check for the chunked ops: the training path's when gradients are needed."""
    return reason(p) if p.needs_grad() else chunk_delta.supports(p)


def run(p: Problem):
    """The Triton tier's entry for the chunked ops."""
    return run_training(p) if p.needs_grad() else chunk_delta.run(p)


class ChunkTraining(torch.autograd.Function):
    """``(o, final state K-first)`` of the activated inputs (a scalar gate ``g`` or a per-channel
    one ``gk``, or neither) and the raw q, k (their l2norm, when the problem asks it, in the
    forward's kernels and in qk_grads for the backward); the backward in Triton. The forward also
    returns the chunk-start states (``return_intermediate_states``, in q's dtype), kept for the
    backward unless ``SAVE_STATES`` is off (the backward then recomputes them: less memory held
    between the passes, one more scan)."""

    @staticmethod
    def forward(ctx, q, k, v, g, gk, beta, h0, problem: Problem):
        save = SAVE_STATES and not chunk_delta_backward.FP32_STATES
        pa = dataclasses.replace(problem, q=q, k=k, v=v, g=g, gk=gk, beta=beta, initial_state=h0,
                                 return_intermediate_states=save)
        out = dispatch.run(problem.op, pa)
        o, ht = out[:2]
        states = out[2].view(-1, *out[2].shape[2:]) if save else None
        ctx.save_for_backward(q, k, v, g, gk, beta, h0, states)
        ctx.problem = problem
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, gk, beta, h0, states = ctx.saved_tensors
        norm = ctx.problem.use_qk_l2norm
        qn, kn = qk_grads.normalize(q, k) if norm else (q, k)
        pa = dataclasses.replace(ctx.problem, q=qn, k=kn, v=v, g=g, gk=gk, beta=beta, initial_state=h0,
                                 use_qk_l2norm=False)
        rule = chunk_channel_backward if gk is not None else chunk_delta_backward
        dq_v, dk_v, dv, dgate, dbeta, dh0 = rule.backward(pa, do, dht, states)
        dq, dk = qk_grads.input_grads(q, k, dq_v, dk_v, norm)
        return (dq, dk, dv, dgate if g is not None else None, dgate if gk is not None else None, dbeta,
                dh0 if h0 is not None else None, None)


def run_training(p: Problem):
    """``(o, final state or None)`` of ``p`` with gradients to every input that requires them."""
    q, k = (p.q.contiguous(), p.k.contiguous()) if p.use_qk_l2norm else (p.q, p.k)
    g = p.g
    if g is not None:
        g = gdn_gate(g, p.A_log, p.dt_bias) if p.gate_in_op == "gdn" else g.float()
    if p.g_gamma is not None:                   # the constant per-head decay, added to g
        gamma = p.g_gamma.float().expand(p.B, p.T, p.HV)
        g = gamma if g is None else g + gamma
    gk = p.gk
    if gk is not None:
        if p.gate_in_op != "kda":
            gk = gk.float()
        elif FUSED_KDA_GATE and gk.dtype != torch.float64:
            gk = gate_grads.kda_gate(gk, p.A_log, p.dt_bias, p.lower_bound)
        else:
            gk = kda_gate(gk, p.A_log, p.dt_bias, p.lower_bound)
        gk = gk.contiguous()
    beta = None
    if p.delta:
        if p.beta is None:
            beta = torch.ones(p.B, p.T, p.HV, dtype=torch.float32, device=p.device)
        elif p.beta_sigmoid:
            beta = beta_activation(p.beta, p.allow_neg_eigval)
        else:
            beta = p.beta.float()
        beta = beta.contiguous()
    h0 = p.initial_state
    if h0 is not None:
        h0 = (h0.transpose(-1, -2) if p.state_v_first else h0).float().contiguous()
    activated = dataclasses.replace(
        p, g_gamma=None, gate_in_op=None, A_log=None, dt_bias=None, lower_bound=None,
        beta_sigmoid=False, allow_neg_eigval=False, state_v_first=False, output_final_state=True)
    o, ht = ChunkTraining.apply(q, k, p.v, g.contiguous() if g is not None else None, gk, beta, h0, activated)
    if not p.output_final_state:
        return o, None
    return o, ht.transpose(-1, -2) if p.state_v_first else ht
