"""The GPU tiers' host code on CPU tensors, with no GPU and no driver: the tiers report that they
can run, Triton's compile is replaced by a stand-in compiled kernel whose launcher records its
calls, and call plans treat floating-point and multi-dimensional CPU tensors as device tensors.
Validation, dispatch, launch planning, the launch keys, TMA descriptors and call plans run as
they do on the GPU. Used by ``benchmarks/gdn_host_overhead.py --stub`` (host time),
``benchmarks/compile_times.py`` (cold-start compiles) and tests/core/test_call_plan.py (the plans'
replays against the full path).

``install(monkeypatch)`` patches through a pytest monkeypatch (undone after the test);
``install()`` patches for the rest of the process. Must run before the kernels are launched and
without ``TRITON_INTERPRET`` (the interpreter's kernels bypass the cached launcher)."""
from __future__ import annotations

from collections import deque

import torch
from triton.runtime.jit import JITFunction


# (StubCompiled, grid, arguments) of the latest launches that reached a C launcher, in order (the
# arguments hold the tensors: a bounded log keeps a long timing loop from holding every call's)
LAUNCHES: deque = deque(maxlen=256)


class StubCompiled:
    """A compiled kernel's stand-in, with a launcher laid out as Triton 3.6's ``CudaLauncher``:
    ``run.launch`` is Triton's own descriptor-expanding wrapper (``wrap_handle_tensordesc``, no
    descriptor metadata, so no driver call) around a C launcher's stand-in that appends each
    launch, descriptors expanded, to ``LAUNCHES``."""

    def __init__(self, name: str, signature: dict):
        self.name = name
        self.function = None
        self.packed_metadata = None
        self.run = _StubLauncher(self, signature)


class _RawLaunch:
    def __init__(self, compiled: StubCompiled):
        self.compiled = compiled

    def __call__(self, gx, gy, gz, stream, function, coop, pdl, scratch, profile, metadata, launch_meta, enter,
                 exit_, *arguments):
        LAUNCHES.append((self.compiled, (gx, gy, gz), arguments))


class _StubLauncher:
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, compiled: StubCompiled, signature: dict):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc

        self.launch = wrap_handle_tensordesc(_RawLaunch(compiled), signature, None)

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, False, False, None, None, *args)


def _compile_stub(self, *args, grid, warmup, **kwargs):
    """``JITFunction.run``'s stand-in (a first launch with a key): a new stub, not launched."""
    signature = {p.name: "tensordesc" if i < len(args) and hasattr(args[i], "block_shape") else "i32"
                 for i, p in enumerate(self.params)}
    return StubCompiled(self.fn.__name__, signature)


def install(monkeypatch=None) -> None:
    import fastla.backends.gluon.chunk_delta as gluon_chunk
    import fastla.backends.gluon.recurrent as gluon_recurrent
    import fastla.backends.triton as triton_backend
    from fastla.backends.triton import launch
    from fastla.core import call_plan

    patches = [
        (triton_backend, "available", lambda device: None),
        (gluon_chunk, "available", lambda device: None),
        (gluon_recurrent, "available", lambda device: None),
        (torch.cuda, "current_device", lambda: 0),
        (launch, "current_stream", lambda device: 0),
        (JITFunction, "run", _compile_stub),
        (call_plan, "_on_device", lambda x: x.is_floating_point() or x.dim() > 1),
    ]
    for obj, name, value in patches:
        if monkeypatch is not None:
            monkeypatch.setattr(obj, name, value)
        else:
            setattr(obj, name, value)
    launch._LAUNCHERS.clear()
    call_plan.clear()


# --- the plans' replays against the full path (python -m fastla.bench.host_stub) ----------------

def _gdn_case(T=200, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, **opts):
    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
        unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=gen), dim=-1).to(dtype)  # noqa: E731
        B = 1
        # unit keys: the delta rule stays bounded with or without the l2norm in the op
        kw = dict(q=unit(B, T, H, K), k=unit(B, T, H, K), v=r(B, T, HV, V), g=-torch.rand(B, T, HV, generator=gen),
                  beta=torch.rand(B, T, HV, generator=gen))
        if opts.get("use_gate_in_kernel"):
            kw.update(A_log=torch.randn(HV, generator=gen), dt_bias=torch.randn(HV, generator=gen))
        if opts.get("h0"):
            shape = (len(opts["cu_seqlens_cpu"]) - 1 if "cu_seqlens_cpu" in opts else B, HV, K, V)
            kw["initial_state"] = torch.randn(*shape, generator=gen)
        kw.update({k: v for k, v in opts.items() if k != "h0"})
        return kw
    return make


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view (each element followed by a zero in memory), as
    q, k, v split from one projection are."""
    return torch.stack([x, torch.zeros_like(x)], -1)[..., 0]


def split_views(kw: dict) -> dict:
    """``kw`` with q, k, v split from one projection and the other tensors but ``cu_seqlens_cpu``
    strided (``strided``), the values unchanged: the tiers read them through dense copies that a
    plan replays (the gluon tier's TMA loads read such q, k, v in place: STRIDED_TMA)."""
    q, k, v = kw["q"], kw["k"], kw["v"]
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)
    views = qkv.split([q[0, 0].numel(), k[0, 0].numel(), v[0, 0].numel()], -1)
    out = {n: strided(x) if isinstance(x, torch.Tensor) and n != "cu_seqlens_cpu" else x for n, x in kw.items()}
    out.update({n: x.view(kw[n].shape) for n, x in zip(("q", "k", "v"), views)})
    return out


def _split(make):
    return lambda seed: split_views(make(seed))


def _kda_case(T=200, H=2, K=128, V=128, **opts):
    def make(seed):
        kw = _gdn_case(T=T, H=H, HV=H, K=K, V=V)(seed)
        gen = torch.Generator().manual_seed(seed + 1)
        kw["g"] = -torch.rand(1, T, H, K, generator=gen)
        if opts.get("use_gate_in_kernel"):
            kw.update(A_log=torch.randn(H, generator=gen), dt_bias=torch.randn(H * K, generator=gen))
        kw.update(opts)
        return kw
    return make


def _plain_case(T=200, H=2, K=128, V=128, gamma=False, g=True, **opts):
    """Simple GLA (``g`` and / or the constant ``g_gamma``) or, without q / k / v's extras, the
    plain rule's inputs for Lightning (``layer_idx`` / ``num_layers`` in ``opts``)."""
    def make(seed):
        kw = _gdn_case(T=T, H=H, HV=H, K=K, V=V, **opts)(seed)
        del kw["beta"]
        if not g:
            del kw["g"]
        if gamma:
            kw["g_gamma"] = -torch.rand(H, generator=torch.Generator().manual_seed(seed + 2))
        return kw
    return make


def _gla_case(T=200, H=2, K=128, V=128, **opts):
    def make(seed):
        kw = _plain_case(T=T, H=H, K=K, V=V)(seed)
        kw["g"] = -torch.rand(1, T, H, K, generator=torch.Generator().manual_seed(seed + 3))
        kw.update(opts)
        return kw
    return make


def _pool_case(N=3, T=4, H=2, HV=4, K=128, V=128):
    """Speculative verify on a state pool: 2-D slots (a slot per token), accepted counts."""
    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        kw = _gdn_case(T=N * T, H=H, HV=HV, K=K, V=V)(seed)
        kw.update(initial_state=torch.randn(2 * N * T, HV, K, V, generator=gen),
                  cu_seqlens=torch.arange(0, N * T + 1, T), cu_seqlens_cpu=torch.arange(0, N * T + 1, T),
                  ssm_state_indices=torch.randperm(2 * N * T, generator=gen)[:N * T].view(N, T).int(),
                  num_accepted_tokens=torch.randint(1, T + 1, (N,), generator=gen).int())
        return kw
    return make


def _stream_pool_case(N=32, H=2, HV=32, K=128, V=128):
    """One token per sequence on a bf16 pool of 64 MB (the sm_90 streaming decode serves 32 MB or
    more), random slots, one row skipped."""
    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        kw = _gdn_case(T=N, H=H, HV=HV, K=K, V=V)(seed)
        slots = torch.randperm(2 * N, generator=gen)[:N].int()
        slots[3] = -1
        kw.update(initial_state=torch.randn(2 * N, HV, K, V, generator=gen).bfloat16(),
                  cu_seqlens=torch.arange(0, N + 1), cu_seqlens_cpu=torch.arange(0, N + 1), ssm_state_indices=slots,
                  use_qk_l2norm_in_kernel=True)
        return kw
    return make


def cases():
    """(name, op, input maker, tier, whether the call must be planned)."""
    from fastla.ops import chunk_gated_delta_rule as gdn
    from fastla.ops import chunk_kda as kda
    from fastla.ops import fused_recurrent_gated_delta_rule as gdn_decode
    from fastla.ops import fused_recurrent_kda as kda_decode
    from fastla.ops import chunk_gla as gla
    from fastla.ops import chunk_lightning_attn as lightning
    from fastla.ops import chunk_simple_gla as simple_gla

    cu = torch.tensor([0, 70, 71, 200])
    one = torch.tensor([0, 8192 + 30])                  # a packed batch of one sequence
    out = []
    for tier in ("gluon", "triton"):
        out += [
            (f"gdn-{tier}", gdn, _gdn_case(output_final_state=True, use_qk_l2norm_in_kernel=True), tier, True),
            (f"gdn-{tier}-h0-vfirst", gdn, _gdn_case(h0=True, state_v_first=True, output_final_state=True), tier,
             True),
            (f"gdn-{tier}-varlen-gate", gdn, _gdn_case(cu_seqlens_cpu=cu, cu_seqlens=cu.clone(), use_gate_in_kernel=True,
                                                       use_beta_sigmoid_in_kernel=True, h0=True), tier, True),
            (f"gdn-{tier}-split-states", gdn, _gdn_case(T=8192, H=1, HV=2, return_intermediate_states=True,
                                                        output_final_state=True), tier, True),
            (f"kda-{tier}-safe-gate", kda, _kda_case(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                                     use_qk_l2norm_in_kernel=True, output_final_state=True), tier,
             True),
            (f"kda-{tier}-given-gate-varlen", kda, _kda_case(cu_seqlens_cpu=cu, cu_seqlens=cu.clone()), tier, True),
            (f"gdn-{tier}-strided-varlen", gdn, _split(_gdn_case(cu_seqlens_cpu=cu, cu_seqlens=cu.clone(), h0=True,
                                                                 use_gate_in_kernel=True)), tier, True),
            (f"kda-{tier}-strided", kda, _split(_kda_case(use_gate_in_kernel=True, lower_bound=-5.0,
                                                          output_final_state=True)), tier, True),
            (f"simple-gla-{tier}-varlen", simple_gla, _plain_case(gamma=True, cu_seqlens_cpu=cu, cu_seqlens=cu.clone(),
                                                                  h0=True, output_final_state=True), tier, True),
            (f"gla-{tier}-varlen", gla, _gla_case(cu_seqlens_cpu=cu, cu_seqlens=cu.clone(), output_final_state=True),
             tier, True),
            (f"kda-{tier}-split-v96", kda, _kda_case(T=8192, H=1, V=96, output_final_state=True), tier, True),
            (f"lightning-{tier}-split", lightning, _plain_case(T=8192, H=1, g=False, layer_idx=2, num_layers=8,
                                                                output_final_state=True), tier, True),
        ]
    out += [
        ("gdn-fp16-inputs", gdn, _gdn_case(dtype=torch.float16), "triton", False),      # cast to fp32 first
        # (GDN's pipeline: two pieces, their prologues on a side stream; one stream off the GPU)
        ("gdn-gluon-pipelined", gdn, _gdn_case(T=8192 + 30, H=2, HV=32, h0=True, output_final_state=True), "gluon",
         True),
        ("gdn-gluon-pipelined-offsets", gdn, _gdn_case(T=8192 + 30, H=2, HV=32, h0=True, output_final_state=True,
                                                       cu_seqlens_cpu=one, cu_seqlens=one.clone()), "gluon", True),
        ("gdn-no-gate-no-beta", gdn, _gdn_case(g=None, beta=None, use_qk_l2norm_in_kernel=True), "gluon", True),
        # (KDA's gated keys formed in the one-chain scan: the prologue writes the norms, not kg, kd, qg)
        ("kda-gluon-gates-in-scan", kda, _kda_case(T=4096, H=64, use_gate_in_kernel=True, lower_bound=-5.0,
                                                   use_qk_l2norm_in_kernel=True, output_final_state=True),
         "gluon", True),
        ("gdn-decode", gdn_decode, _gdn_case(T=1, h0=True, output_final_state=True, use_qk_l2norm_in_kernel=True),
         "triton", True),
        ("kda-decode", kda_decode, _kda_case(T=1, output_final_state=True), "triton", True),
        ("gdn-verify-pool", gdn_decode, _pool_case(), "triton", True),
        ("gdn-decode-bf16-pool", gdn_decode, _stream_pool_case(), "gluon", True),
    ]
    return out


def _canonical(launches, inputs: dict, result):
    """Launches and result with every address named: an input by its argument name, anything
    else by its order of first appearance."""
    names = {x.data_ptr(): n for n, x in inputs.items() if isinstance(x, torch.Tensor)}
    seen: dict = {}

    def addr(a):
        return names.get(a) or ("buffer", seen.setdefault(a, len(seen)))

    def canon(v):
        if hasattr(v, "data_ptr"):                          # a tensor, or a replay's address
            return addr(v.data_ptr())
        if type(v) is int and v in names or v in seen:      # a descriptor's base address, expanded
            return addr(v)
        if hasattr(v, "block_shape") and hasattr(v, "base"):
            return ("desc", addr(v.base.data_ptr()), tuple(v.shape), tuple(v.strides), tuple(v.block_shape),
                    v.layout, v.padding)
        return v

    calls = [(c.name, grid, [canon(v) for v in values]) for c, grid, values in launches]
    outs = [None if x is None else (canon(x), tuple(x.shape), x.stride(), x.dtype) for x in result]
    return calls, outs


def check_plans() -> list[str]:
    """For each case: the launches and result of a replayed plan against the full path's on the
    same inputs. Returns the failures."""
    from fastla.core import call_plan
    from fastla.core.dispatch import use_tier

    failures = []
    for name, op, make, tier, must_plan in cases():
        x, y = make(0), make(1)
        with use_tier(tier, strict=True), torch.no_grad():
            call_plan.ENABLED = False
            op(**x)
            LAUNCHES.clear()
            full = _canonical(LAUNCHES, x, op(**x))
            call_plan.ENABLED = True
            call_plan.clear()
            op(**y)                                 # noted
            op(**y)                                 # recorded
            plan = op.plan_of(**y)
            planned = plan is not None and not isinstance(plan, str)
            LAUNCHES.clear()
            replay = _canonical(LAUNCHES, x, op(**x))
        if planned != must_plan:
            failures.append(f"{name}: planned {planned}, expected {must_plan} ({plan})")
        elif full != replay:
            failures.append(f"{name}: the replay differs from the full path:\n  {full}\n  {replay}")
        else:
            print(f"{name}: {'planned, replay matches' if planned else 'not planned'} ({len(full[0])} launches)")
        if planned:
            failures += _check_copies(name, plan, x, _read_in_place(x))
    failures += _check_replayed_validation()
    failures += _check_in_place_views()
    return failures


def _check_in_place_views() -> list[str]:
    """With gluon_chunk.STRIDED_TMA, q, k, v split from one projection reach every launch as
    the views themselves (TMA descriptors with the projection's row stride), are not copied, and
    the plan replays that."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.core import call_plan
    from fastla.core.dispatch import use_tier
    from fastla.ops import chunk_gated_delta_rule as gdn
    from fastla.ops import chunk_kda as kda

    failures = []
    for name, op, make in (("gdn", gdn, _gdn_case(h0=True, output_final_state=True, use_qk_l2norm_in_kernel=True)),
                           ("kda", kda, _kda_case(use_gate_in_kernel=True, lower_bound=-5.0, output_final_state=True))):
        x = _split(make)(0)
        width = x["q"].stride(1)
        strided, enabled = gluon_chunk.STRIDED_TMA, call_plan.ENABLED
        gluon_chunk.STRIDED_TMA, call_plan.ENABLED = True, True
        try:
            with use_tier("gluon", strict=True), torch.no_grad():
                call_plan.clear()
                op(**x)
                op(**x)
                plan = op.plan_of(**x)
                LAUNCHES.clear()
                op(**x)
        finally:
            gluon_chunk.STRIDED_TMA, call_plan.ENABLED = strided, enabled
            call_plan.clear()
        if isinstance(plan, str) or plan is None:
            failures.append(f"{name}: strided q, k, v in place: not planned ({plan})")
            continue
        copied = {plan.paths[i] for i, _ in plan.copies}
        if copied & {"q", "k", "v"} or not copied:
            failures.append(f"{name}: strided q, k, v in place: the plan copies {sorted(copied)}")
            continue
        seen = _read_in_place(x)
        if seen != {"q", "k", "v"}:
            failures.append(f"{name}: strided q, k, v in place: the launches read {sorted(seen)} at their addresses")
            continue
        print(f"{name}: strided q, k, v in place: read at their addresses (row stride {width}), "
              f"{len(copied)} other inputs copied")
    return failures


def _read_in_place(kw: dict) -> set[str]:
    """The strided q, k, v of ``kw`` that the launches in LAUNCHES read at their own addresses with
    their row stride: an expanded TMA descriptor is (base address, rows, width, row stride, 1, ...)."""
    views = {kw[n].data_ptr(): n for n in ("q", "k", "v") if n in kw and not kw[n].is_contiguous()}
    strides = {n: kw[n].stride(1) for n in views.values()}
    return {views[int(v)] for _, _, values in LAUNCHES for i, v in enumerate(values[:-3])
            if isinstance(v, int) and int(v) in views and tuple(values[i + 3:i + 5]) == (strides[views[int(v)]], 1)}


def _check_copies(name: str, plan, kw: dict, in_place: set[str]) -> list[str]:
    """A plan copies each non-contiguous input of the call (call_plan.dense) before its launches,
    but the q, k, v views its launches read in place (``in_place``; the gluon tier's STRIDED_TMA):
    the replay's copies are contiguous and hold the call's values."""
    strided = sum(isinstance(x, torch.Tensor) and not x.is_contiguous() for x in kw.values()) - len(in_place)
    if len(plan.copies) != strided:
        return [f"{name}: {len(plan.copies)} dense copies recorded for {strided} strided inputs "
                f"({len(in_place)} more read in place)"]
    tensors, calls, _ = plan.bind((), kw)
    for _, c in plan.copies:
        tensors[c].fill_(-7)                        # (fresh memory may already hold the values)
    for fn, args in calls[:len(plan.copies)]:
        fn(*args)
    if not all(tensors[c].is_contiguous() and torch.equal(tensors[c], tensors[i]) for i, c in plan.copies):
        return [f"{name}: a replayed dense copy differs from its input"]
    if strided or in_place:
        print(f"{name}: {strided} strided inputs copied before the launches, {sorted(in_place)} read in place")
    return []


def _check_replayed_validation() -> list[str]:
    """A replayed pool call still refuses an out-of-range slot (its value check runs again)."""
    from fastla.core import call_plan
    from fastla.ops import fused_recurrent_gated_delta_rule as op

    x = _pool_case()(0)
    with torch.no_grad():
        op(**x)
        op(**x)
        plan = op.plan_of(**x)
        x["ssm_state_indices"][0, 0] = x["initial_state"].shape[0]
        try:
            op(**x)
        except ValueError as exc:
            if "out of range" in str(exc) and not isinstance(plan, str) and call_plan.ENABLED:
                print("gdn-verify-pool: the replay refuses an out-of-range slot")
                return []
        return [f"gdn-verify-pool: a replay with an out-of-range slot did not raise (plan: {plan})"]


def check_compile_ahead() -> list[str]:
    """fastla/core/compile_ahead.py, for each chunked case: the first call of a class submits every
    kernel the call compiles (``JITFunction.run`` with ``warmup``, Triton's ``AsyncCompileMode`` in
    force) before the real pass compiles or launches anything, the same kernels as a call without
    it; a second call of the class submits nothing. Returns the failures."""
    from triton.runtime import _async_compile

    from fastla.backends.triton import launch
    from fastla.core import call_plan, compile_ahead
    from fastla.core.dispatch import use_tier

    events = []                         # (kernel, warmup, an AsyncCompileMode in force)

    def run(self, *args, grid, warmup, **kwargs):
        events.append((self.fn.__name__, warmup, _async_compile.active_mode.get() is not None))
        return stub(self, *args, grid=grid, warmup=warmup, **kwargs)

    def call(op, x, ahead: bool) -> list:
        compile_ahead.ENABLED = ahead
        events.clear()
        op(**x)
        return list(events)

    stub, enabled, plans = JITFunction.run, compile_ahead.ENABLED, call_plan.ENABLED
    JITFunction.run, call_plan.ENABLED = run, False         # (a recording, the second call, runs no dry pass)
    failures = []
    try:
        for name, op, make, tier, _ in cases():
            if not op.__name__.startswith("chunk_"):
                continue
            x = make(0)
            with use_tier(tier, strict=True), torch.no_grad():
                launch._LAUNCHERS.clear()
                serial = call(op, x, ahead=False)
                launch._LAUNCHERS.clear()
                compile_ahead.clear()
                first = call(op, x, ahead=True)
                launch._LAUNCHERS.clear()
                again = call(op, x, ahead=True)
            submitted = [e for e in first if e[1]]
            compiled = sorted(n for n, *_ in serial)
            if not submitted or any(not e[2] for e in submitted) or first[:len(submitted)] != submitted:
                failures.append(f"{name}: compile ahead: the first call's submissions {first}")
            elif sorted(n for n, *_ in submitted) != compiled or first[len(submitted):] != serial:
                failures.append(f"{name}: compile ahead: submitted {submitted}, then {first[len(submitted):]}; "
                                f"without it {serial}")
            elif again != serial:
                failures.append(f"{name}: compile ahead: a second call of the class ran {again}")
            else:
                print(f"{name}: compile ahead: {len(submitted)} kernels submitted before the first launch")
    finally:
        JITFunction.run, compile_ahead.ENABLED, call_plan.ENABLED = stub, enabled, plans
        compile_ahead.clear()
    return failures


if __name__ == "__main__":
    import os
    import sys

    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("host_stub needs compiled-kernel launches: unset TRITON_INTERPRET")
    install()
    problems = check_compile_ahead() + check_plans()
    print("\n".join(problems) or "all replays match")
    sys.exit(1 if problems else 0)
