"""The public ops as ``torch.library`` custom ops, for ``torch.compile(fullgraph=True)``.

Eager calls never come here. Under ``torch.compile`` the public ``fused_recurrent_*``
functions call ``torch.ops.fastla.recurrent`` (or ``recurrent_pool``, which updates the state
pool in place) and the ``chunk_*`` functions ``torch.ops.fastla.chunk``, so that the graph holds
one opaque op: validation (which reads host values) and dispatch then run when the compiled
graph runs, and the fake implementations give the compiler the output shapes. Forward only: a
compiled call that needs gradients, or a chunked call that returns the intermediate states (their
count depends on the offsets' values) or checks FLA's ``chunk_indices``, is traced through the
Python path instead (with graph breaks where its host code reads values or launches kernels).
"""
from __future__ import annotations

import torch
from torch import Tensor

from fastla.core import dispatch
from fastla.core.validation import build_problem


def _problem(op, q, k, v, g, gk, gv, beta, A_log, dt_bias, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu,
             ssm_state_indices, num_accepted_tokens, scale, lower_bound, delta, gva, gate_in_op, use_qk_l2norm,
             beta_sigmoid, allow_neg_eigval, output_final_state, state_v_first, reverse, disable_state_update,
             output_like, **chunked):
    return build_problem(
        op, q=q, k=k, v=v, g=g, gk=gk, gv=gv, g_gamma=g_gamma, beta=beta, delta=delta, gva=gva,
        gate_in_op=gate_in_op or None, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_qk_l2norm=use_qk_l2norm, beta_sigmoid=beta_sigmoid, allow_neg_eigval=allow_neg_eigval, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, reverse=reverse,
        ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
        disable_state_update=disable_state_update, output_like=output_like, **chunked,
    )


_SCHEMA_ARGS = (
    "str op, Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? gk, Tensor? gv, Tensor? beta, Tensor? A_log, "
    "Tensor? dt_bias, Tensor? g_gamma, {state}, Tensor? cu_seqlens, Tensor? cu_seqlens_cpu, "
    "Tensor? ssm_state_indices, Tensor? num_accepted_tokens, float scale, float? lower_bound, bool delta, bool gva, "
    "str gate_in_op, bool use_qk_l2norm, bool beta_sigmoid, bool allow_neg_eigval, bool output_final_state, "
    "bool state_v_first, bool reverse, bool disable_state_update, str output_like"
)

_lib = torch.library.Library("fastla", "DEF")
_lib.define(f"recurrent({_SCHEMA_ARGS.format(state='Tensor? initial_state')}) -> (Tensor, Tensor)")
_lib.define(f"recurrent_pool({_SCHEMA_ARGS.format(state='Tensor(a!) initial_state')}) -> Tensor")
_lib.define(f"chunk({_SCHEMA_ARGS.format(state='Tensor? initial_state')}, bool safe_gate, int chunk_size) "
            "-> (Tensor, Tensor)")


def _o_and_final(result):
    """(o, the final state or an empty tensor): a fresh contiguous state, as the fake promises (a
    custom op may not return a view)."""
    o, final = result[:2]
    return o, final.contiguous() if final is not None else o.new_empty(0)


def _recurrent_impl(*args):
    return _o_and_final(dispatch.run(args[0], _problem(*args)))


def _recurrent_pool_impl(*args):
    return dispatch.run(args[0], _problem(*args))[0]


def _chunk_impl(*args):
    *args, safe_gate, chunk_size = args
    return _o_and_final(dispatch.run(args[0], _problem(*args, safe_gate=safe_gate, chunk_size=chunk_size)))


def _output(q, v, output_like):
    return torch.empty(v.shape, dtype=(q if output_like == "q" else v).dtype, device=q.device)


def _recurrent_fake(op, q, k, v, g, gk, gv, beta, A_log, dt_bias, g_gamma, initial_state, cu_seqlens,
                    cu_seqlens_cpu, ssm_state_indices, num_accepted_tokens, scale, lower_bound, delta, gva, gate_in_op,
                    use_qk_l2norm, beta_sigmoid, allow_neg_eigval, output_final_state, state_v_first, reverse,
                    disable_state_update, output_like):
    o = _output(q, v, output_like)
    if not output_final_state:
        return o, o.new_empty(0)
    varlen = cu_seqlens if cu_seqlens is not None else cu_seqlens_cpu
    N = q.shape[0] if varlen is None else varlen.shape[0] - 1
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32      # as the tiers return
    return o, torch.empty(shape, dtype=state_dtype, device=q.device)


def _recurrent_pool_fake(op, q, k, v, *rest):
    return _output(q, v, rest[-1])


def _chunk_fake(*args):
    return _recurrent_fake(*args[:-2])                      # (the outputs do not depend on safe_gate, chunk_size)


for _backend in ("CPU", "CUDA"):
    _lib.impl("recurrent", _recurrent_impl, _backend)
    _lib.impl("recurrent_pool", _recurrent_pool_impl, _backend)
    _lib.impl("chunk", _chunk_impl, _backend)
torch.library.register_fake("fastla::recurrent", _recurrent_fake, lib=_lib)
torch.library.register_fake("fastla::recurrent_pool", _recurrent_pool_fake, lib=_lib)
torch.library.register_fake("fastla::chunk", _chunk_fake, lib=_lib)


def compiled_recurrent(op: str, **kw):
    """The public recurrent op's call as one custom op (used while ``torch.compile`` traces)."""
    if kw["ssm_state_indices"] is not None:
        o = torch.ops.fastla.recurrent_pool(op, **kw)
        return o, kw["initial_state"]
    o, final = torch.ops.fastla.recurrent(op, **kw)
    return o, final if kw["output_final_state"] else None


def _needs_grad(kw: dict) -> bool:
    if not torch.is_grad_enabled():
        return False
    unused = () if kw.get("gate_in_op") else ("A_log", "dt_bias")   # dropped by validation without the gate
    return any(x.requires_grad for n, x in kw.items() if isinstance(x, Tensor) and n not in unused)


def _op_args(kw: dict) -> dict:
    """A public call's build_problem keywords as the custom ops' schema takes them."""
    args = {n: kw.get(n) for n in (
        "q", "k", "v", "g", "gk", "gv", "beta", "A_log", "dt_bias", "g_gamma", "initial_state", "cu_seqlens",
        "cu_seqlens_cpu", "ssm_state_indices", "num_accepted_tokens", "lower_bound")}
    args.update(
        gate_in_op=kw.get("gate_in_op") or "",                 # (the schema's str: "" for none)
        scale=float(kw["scale"]) if kw.get("scale") is not None else kw["q"].shape[-1] ** -0.5,
        delta=kw["delta"], gva=kw["gva"], use_qk_l2norm=bool(kw.get("use_qk_l2norm")), beta_sigmoid=bool(kw.get("beta_sigmoid")),
        allow_neg_eigval=bool(kw.get("allow_neg_eigval")), output_final_state=bool(kw.get("output_final_state")),
        state_v_first=bool(kw.get("state_v_first")), reverse=bool(kw.get("reverse")),
        disable_state_update=bool(kw.get("disable_state_update")), output_like=kw.get("output_like", "q"),
    )
    return args


def run_recurrent(op: str, **kw):
    """Serve a public recurrent call: validated and dispatched now, or, while ``torch.compile``
    traces a call that needs no gradients, recorded as one custom op."""
    if torch.compiler.is_compiling() and not _needs_grad(kw):
        return compiled_recurrent(op, **_op_args(kw))
    return dispatch.run(op, build_problem(op, **kw))


def run_chunk(op: str, check=None, **kw):
    """Serve a public chunked call: validated (then ``check(problem)``, when given) and dispatched
    now, or, while ``torch.compile`` traces a call that needs no gradients, no intermediate states
    and no ``check``, recorded as one custom op."""
    if (torch.compiler.is_compiling() and not _needs_grad(kw) and not kw.get("return_intermediate_states")
            and check is None):
        args = _op_args(kw)
        o, final = torch.ops.fastla.chunk(op, **args, safe_gate=bool(kw.get("safe_gate")),
                                          chunk_size=int(kw.get("chunk_size") or 64))
        return o, final if args["output_final_state"] else None
    problem = build_problem(op, **kw)
    if check is not None:
        check(problem)
    return dispatch.run(op, problem)
