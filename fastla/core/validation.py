"""Argument validation for every public op, in one place.

Bad input raises ``ValueError`` naming the argument, what was expected and what came;
an option no tier can serve raises ``NotImplementedError`` naming it. The result is a
:class:`~fastla.core.problem.Problem`.

Value checks on ``cu_seqlens`` and ``ssm_state_indices`` read those tensors on the host:
pass ``cu_seqlens_cpu`` to avoid the device-to-host copy for ``cu_seqlens`` (it is then
trusted to hold the same offsets as a CUDA ``cu_seqlens``; a CPU pair is compared). While a CUDA
graph is being captured, checks that would read device memory are skipped (a sync is not
allowed there): capture after an eager call with the same kind of inputs.
"""
from __future__ import annotations

import math
import operator
import warnings

import torch

from fastla.core.call_plan import value_check
from fastla.core.problem import Pool, Problem

MAX_HEAD_DIM = 256
_INT_DTYPES = (torch.int32, torch.int64)


def resolve_state_layout(state_v_first: bool, transpose_state_layout: bool | None) -> bool:
    """Accept FLA's deprecated ``transpose_state_layout`` alias of ``state_v_first``."""
    if transpose_state_layout is None:
        return bool(state_v_first)
    if state_v_first:
        raise ValueError("pass either state_v_first or the deprecated transpose_state_layout, not both")
    warnings.warn("transpose_state_layout is deprecated; use state_v_first", DeprecationWarning, stacklevel=3)
    return bool(transpose_state_layout)


def reject_head_first(head_first: bool) -> None:
    if head_first:
        raise ValueError("head_first=True is not supported: inputs must be [B, T, H, ...] (FLA removed head_first)")


def reject_cp_context(cp_context) -> None:
    if cp_context is not None:
        raise NotImplementedError("cp_context (context parallelism across devices) is not supported by fastla yet")


def check_chunk_size(chunk_size: int | None, allowed: tuple[int, ...] | None, default: int = 64) -> int:
    """FLA's ``chunk_size`` keyword: ``allowed`` lists the accepted sizes (None: any power of two)."""
    if chunk_size is None:
        return default
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if allowed is None:
        if chunk_size & (chunk_size - 1):
            raise ValueError(f"chunk_size must be a power of 2, got {chunk_size}")
    elif chunk_size not in allowed:
        raise ValueError(f"chunk_size must be one of {allowed}, got {chunk_size}")
    return chunk_size


def check_lightning_layers(layer_idx, num_layers) -> None:
    """Lightning's decay needs ``0 <= layer_idx <= num_layers`` (else the state would grow)."""
    try:
        num_layers, layer_idx = operator.index(num_layers), operator.index(layer_idx)
    except TypeError:
        raise ValueError(f"layer_idx and num_layers must be ints, got {layer_idx!r} and {num_layers!r}") from None
    if num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    if not 0 <= layer_idx <= num_layers:
        raise ValueError(f"layer_idx must be an int in [0, num_layers={num_layers}], got {layer_idx!r}")


def check_chunk_indices(chunk_indices, problem: Problem) -> None:
    """FLA's precomputed ``chunk_indices`` ``[total chunks, 2]``: checked against ``cu_seqlens``.

    fastla derives the chunk index itself; a given one must agree in shape and dtype.
    """
    if chunk_indices is None:
        return
    if problem.cu_seqlens is None and problem.cu_seqlens_host is None:
        raise ValueError("chunk_indices is only meaningful with cu_seqlens")
    if problem.cu_seqlens_host is None:
        return
    cu = problem.cu_seqlens_host
    total = sum(-(-(e - s) // problem.chunk_size) for s, e in zip(cu[:-1], cu[1:]))
    if not isinstance(chunk_indices, torch.Tensor) or chunk_indices.dtype not in _INT_DTYPES:
        raise ValueError("chunk_indices must be an int32 or int64 tensor")
    if tuple(chunk_indices.shape) != (total, 2):
        raise ValueError(f"chunk_indices must have shape [{total}, 2] for these cu_seqlens, got {list(chunk_indices.shape)}")


def _can_read(x: torch.Tensor) -> bool:
    """Whether reading ``x``'s values on the host is allowed now (not during graph capture)."""
    return x.device.type == "cpu" or not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _tensor(name: str, x, shape: tuple[int, ...] | None = None, device=None, floating: bool = True):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}")
    return x


def _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B: int, T: int, device) -> tuple[int, ...] | None:
    if cu_seqlens is None and cu_seqlens_cpu is None:
        return None
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size B == 1 (flattened sequences), got B={B}")
    source_name = "cu_seqlens_cpu" if cu_seqlens_cpu is not None else "cu_seqlens"
    for name, x in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got dtype {x.dtype}")
        if x.dim() != 1 or x.numel() < 2:
            raise ValueError(f"{name} must have shape [N+1] with N >= 1, got {list(x.shape)}")
    if cu_seqlens is not None and cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type != "cpu":
        # (FLA takes it; each call then waits on the device to read it)
        warnings.warn(f"cu_seqlens_cpu is on {cu_seqlens_cpu.device}: reading its offsets synchronizes with the "
                      "device at every call; pass a CPU tensor", RuntimeWarning, stacklevel=5)
    if cu_seqlens is not None and cu_seqlens_cpu is not None and cu_seqlens.numel() != cu_seqlens_cpu.numel():
        raise ValueError(
            f"cu_seqlens_cpu must match cu_seqlens: {cu_seqlens_cpu.numel()} vs {cu_seqlens.numel()} entries"
        )
    if (cu_seqlens is not None and cu_seqlens_cpu is not None and cu_seqlens.device.type == "cpu"
            and not torch.equal(cu_seqlens.to(torch.int64), cu_seqlens_cpu.to(torch.int64))):
        raise ValueError("cu_seqlens_cpu must hold the same offsets as cu_seqlens")
    cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    if not _can_read(cu):
        return None
    values = [int(x) for x in cu.tolist()]
    if values[0] != 0:
        raise ValueError(f"{source_name} must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values[:-1], values[1:])):
        raise ValueError(f"{source_name} must be non-decreasing, got {values}")
    if values[-1] != T:
        raise ValueError(f"{source_name} must end at T={T} (the number of tokens), got {values[-1]}")
    return tuple(values)


def _check_pool(ssm_state_indices, num_accepted_tokens, disable_state_update, initial_state, N, device):
    if ssm_state_indices is None:
        if num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens requires ssm_state_indices (a state pool)")
        return None
    if initial_state is None:
        raise ValueError("ssm_state_indices requires initial_state: the state pool [slots, HV, K, V]")
    idx = ssm_state_indices
    if not isinstance(idx, torch.Tensor) or idx.dtype not in _INT_DTYPES:
        raise ValueError(f"ssm_state_indices must be an int32 or int64 tensor, got {getattr(idx, 'dtype', type(idx))}")
    if idx.device != device:
        raise ValueError(f"ssm_state_indices is on {idx.device} but q is on {device}")
    if idx.dim() not in (1, 2) or idx.shape[0] != N:
        raise ValueError(f"ssm_state_indices must have shape [N] or [N, T] with N={N} sequences, got {list(idx.shape)}")
    slots = initial_state.shape[0]
    nat = num_accepted_tokens
    if nat is not None:
        if not isinstance(nat, torch.Tensor) or nat.dtype not in _INT_DTYPES:
            raise ValueError("num_accepted_tokens must be an int32 or int64 tensor")
        if tuple(nat.shape) != (N,):
            raise ValueError(f"num_accepted_tokens must have shape [{N}], got {list(nat.shape)}")
        if nat.device != device:
            raise ValueError(f"num_accepted_tokens is on {nat.device} but q is on {device}")
        if idx.dim() != 2:
            raise ValueError("num_accepted_tokens requires 2-D ssm_state_indices [N, T] (a slot per token)")
    if _can_read(idx) and idx.numel():
        # a call plan runs this check again at every replay (fastla/core/call_plan.py)
        value_check(_check_pool_values, (idx,) if nat is None else (idx, nat), slots=slots)
    return Pool(idx, num_accepted_tokens, bool(disable_state_update))


def _check_pool_values(idx, nat=None, *, slots: int) -> None:
    """The pool's value checks in one device-to-host read (one sync on a GPU, not one per check)."""
    if nat is None:
        top, accepted = int(idx.max()), ()
    else:
        top, *accepted = torch.stack([x.to(torch.int64) for x in (idx.max(), nat.min(), nat.max())]).tolist()
    if top >= slots:
        raise ValueError(f"ssm_state_indices out of range: max index {top} but the pool has {slots} slots")
    if accepted and (accepted[0] < 1 or accepted[1] > idx.shape[1]):
        raise ValueError(f"num_accepted_tokens must lie in [1, {idx.shape[1]}], got [{accepted[0]}, {accepted[1]}]")


def build_problem(
    op: str,
    *,
    q,
    k,
    v,
    delta: bool,
    gva: bool,
    g=None,
    gk=None,
    gv=None,
    g_gamma=None,
    beta=None,
    gate_in_op: str | None = None,
    A_log=None,
    dt_bias=None,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    use_qk_l2norm: bool = False,
    beta_sigmoid: bool = False,
    allow_neg_eigval: bool = False,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    reverse: bool = False,
    chunk_size: int = 64,
    return_intermediate_states: bool = False,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    disable_state_update: bool = False,
    output_like: str = "q",
) -> Problem:
    """Validate one call and describe it. ``gva``: whether ``v`` may have more heads than q/k;
    ``output_like``: ``"q"`` or ``"v"``, whose dtype the output takes (as FLA's op does)."""
    _tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {list(q.shape)}")
    B, T, H, K = q.shape
    if H < 1:
        raise ValueError(f"q must have at least one head, got shape {list(q.shape)}")
    device = q.device
    _tensor("k", k, (B, T, H, K), device)
    if k.dtype != q.dtype:
        raise ValueError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    _tensor("v", v, device=device)
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must have shape [B={B}, T={T}, HV, V], got {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if gva:
        if HV % H != 0:
            raise ValueError(f"v has HV={HV} heads, which must be a multiple of the H={H} heads of q and k")
    elif HV != H:
        raise ValueError(f"v must have the H={H} heads of q and k, got {HV}")
    for name, d in (("K (q/k head dim)", K), ("V (v head dim)", V)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name}={d} is not supported: head dims 1..{MAX_HEAD_DIM} are")

    if g is not None:
        _tensor("g", g, (B, T, HV), device)
    if gk is not None:
        _tensor("g" if delta else "gk", gk, (B, T, HV, K), device)
    if gv is not None:
        _tensor("gv", gv, (B, T, HV, V), device)
    if g_gamma is not None:
        _tensor("g_gamma", g_gamma, (HV,), device)
    if beta is not None:
        _tensor("beta", beta, device=device)
        if beta.dim() == 4 and tuple(beta.shape) == (B, T, HV, V):
            raise NotImplementedError("beta of shape [B, T, HV, V] (a beta per value channel) is not supported yet")
        _tensor("beta", beta, (B, T, HV))

    if gate_in_op is not None and (g if gate_in_op == "gdn" else gk) is None:
        raise ValueError("g (the raw gate input) must be given when use_gate_in_kernel=True")
    if gate_in_op is None:
        A_log, dt_bias = None, None          # only read by the gate computed in the op (as FLA)
    if allow_neg_eigval and not beta_sigmoid:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if gate_in_op == "gdn" and A_log is None:
        raise ValueError("A_log must be given when use_gate_in_kernel=True")
    if gate_in_op == "kda" and A_log is None and lower_bound is None:
        raise ValueError("A_log must be given when use_gate_in_kernel=True and lower_bound is not set")
    if safe_gate and gate_in_op == "kda":
        if lower_bound is None:
            raise ValueError("lower_bound must be given when safe_gate=True and use_gate_in_kernel=True")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound must be in [-5, 0) with safe_gate=True, got {lower_bound}")
    if gate_in_op is not None:
        if A_log is not None:
            _tensor("A_log", A_log, (HV,), device)
        if dt_bias is not None:
            _tensor("dt_bias", dt_bias, (HV * K,) if gate_in_op == "kda" else (HV,), device)

    if scale is None:
        scale = K ** -0.5
    try:
        scale = float(scale)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"scale must be a number, got {scale!r}") from None
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")

    cu_host = _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T, device)
    varlen = cu_seqlens if cu_seqlens is not None else cu_seqlens_cpu
    N = B if varlen is None else varlen.shape[0] - 1

    pool = _check_pool(ssm_state_indices, num_accepted_tokens, disable_state_update, initial_state, N, device)
    if pool is not None and pool.indices.dim() == 2 and (varlen is None or cu_host is not None):
        longest = T if cu_host is None else max(e - s for s, e in zip(cu_host[:-1], cu_host[1:]))
        if pool.indices.shape[1] < max(1, longest):
            raise ValueError(
                f"2-D ssm_state_indices need a slot per token: shape [N, >= {max(1, longest)}], "
                f"got {list(pool.indices.shape)}"
            )
    if initial_state is not None:
        state_tail = (HV, V, K) if state_v_first else (HV, K, V)
        layout = "[N, HV, V, K] (state_v_first=True)" if state_v_first else "[N, HV, K, V]"
        _tensor("initial_state", initial_state, device=device)
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != state_tail:
            raise ValueError(
                f"initial_state must have shape {layout} = [{'slots' if pool else N}, {', '.join(map(str, state_tail))}], "
                f"got {list(initial_state.shape)}"
            )
        if pool is None and initial_state.shape[0] != N:
            raise ValueError(
                f"initial_state must hold one state per sequence: N={N}, got {initial_state.shape[0]}"
            )

    return Problem(
        op=op, q=q, k=k, v=v, g=g, gk=gk, gv=gv, g_gamma=g_gamma, beta=beta, delta=delta,
        gate_in_op=gate_in_op, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_qk_l2norm=bool(use_qk_l2norm), beta_sigmoid=bool(beta_sigmoid), allow_neg_eigval=bool(allow_neg_eigval),
        scale=float(scale), initial_state=initial_state, output_final_state=bool(output_final_state),
        state_v_first=bool(state_v_first), cu_seqlens=cu_seqlens, cu_seqlens_host=cu_host, reverse=bool(reverse),
        chunk_size=chunk_size, return_intermediate_states=bool(return_intermediate_states), pool=pool,
        o_dtype=(q if output_like == "q" else v).dtype, B=B, T=T, H=H, HV=HV, K=K, V=V, N=N,
    )
