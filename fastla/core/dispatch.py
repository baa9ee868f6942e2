"""The one place that picks the tier serving a call.

Tiers, fastest first: ``gluon`` (Hopper sm_90 kernels), ``triton`` (portable CUDA
kernels), ``torch`` (the chunked PyTorch tier, any device). Each tier registers, per
public op, a ``supports(problem) -> str | None`` check (``None`` means it can serve; a
string says why not) and an implementation. ``FASTLA_BACKEND=torch|triton|gluon`` (or
:func:`use_tier`) makes a tier the first one tried; a tier that cannot serve a call
logs its reason once and the next tier serves it. ``torch`` serves every call. Before a GPU
tier serves the first chunked call of a class, ``compile_ahead`` compiles its kernels side by side.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Callable

from fastla.core import compile_ahead

logger = logging.getLogger("fastla")

TIERS = ("gluon", "triton", "torch")


@dataclass(frozen=True)
class TierImpl:
    supports: Callable[[object], str | None]
    run: Callable[..., object]


_REGISTRY: dict[tuple[str, str], TierImpl] = {}
_LOGGED: set[tuple[str, str, str]] = set()
_forced: list[tuple[str, bool]] = []


def register(op: str, tier: str, supports: Callable[[object], str | None]):
    """Decorator: register ``fn`` as tier ``tier``'s implementation of ``op``."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")

    def wrap(fn):
        _REGISTRY[(op, tier)] = TierImpl(supports, fn)
        return fn

    return wrap


def requested_tier() -> str | None:
    """The tier forced by :func:`use_tier` or ``FASTLA_BACKEND`` (None: automatic)."""
    if _forced:
        return _forced[-1][0]
    env = os.environ.get("FASTLA_BACKEND", "").strip().lower()
    if env and env not in TIERS:
        raise ValueError(f"FASTLA_BACKEND must be one of {TIERS}, got {env!r}")
    return env or None


def forced_state() -> tuple:
    """What ``use_tier`` and ``FASTLA_BACKEND`` force now (part of a call plan's signature)."""
    return (_forced[-1] if _forced else None), os.environ.get("FASTLA_BACKEND")


@contextlib.contextmanager
def use_tier(tier: str, strict: bool = False):
    """Within the block, try ``tier`` first (as ``FASTLA_BACKEND`` does). With ``strict``, a
    call that ``tier`` cannot serve raises instead of falling through (tests use this)."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    _forced.append((tier, strict))
    try:
        yield
    finally:
        _forced.pop()


def candidate_order() -> tuple[str, ...]:
    first = requested_tier()
    if first is None:
        return TIERS
    return TIERS[TIERS.index(first):]


def _reasons(op: str, problem):
    """``(tier, reason it cannot serve or None)`` for each tier in the order tried, lazily."""
    for tier in candidate_order():
        impl = _REGISTRY.get((op, tier))
        yield tier, "not implemented in this tier yet" if impl is None else impl.supports(problem)


def explain(op: str, problem) -> list[tuple[str, str | None]]:
    """For each tier in the order tried: ``(tier, reason it cannot serve or None)``."""
    return list(_reasons(op, problem))


def select(op: str, problem) -> tuple[str, TierImpl]:
    """The first tier able to serve ``problem`` (later tiers are not asked); logs each skipped
    tier's reason once."""
    strict = bool(_forced) and _forced[-1][1]
    tried = []
    for tier, reason in _reasons(op, problem):
        tried.append((tier, reason))
        if strict and reason is not None:
            raise RuntimeError(f"{tier} tier cannot serve {op}: {reason}")
        if reason is None:
            return tier, _REGISTRY[(op, tier)]
        key = (op, tier, reason)
        if key not in _LOGGED:
            _LOGGED.add(key)
            logger.info("fastla: %s tier cannot serve %s (%s); trying the next tier", tier, op, reason)
    reasons = "; ".join(f"{tier}: {reason}" for tier, reason in tried)
    raise RuntimeError(f"no fastla tier can serve this {op} call ({reasons})")


def run(op: str, problem):
    tier, impl = select(op, problem)
    compile_ahead.before(op, tier, impl.run, problem)
    return impl.run(problem)
