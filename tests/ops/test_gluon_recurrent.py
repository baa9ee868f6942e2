"""The sm_90 streaming decode (backends/gluon/recurrent_sm90.py) on the GPU: every op, fp32 and bf16
states, both state layouts, the pool in place with skipped slots, FLA's form, the gates in the op,
several tiles per program and every stage count shipped; against the fp64 token-by-token reference,
outputs poisoned beforehand."""
import contextlib

import pytest
import torch

from fastla.backends.gluon import recurrent as gluon_recurrent
from fastla.core.dispatch import use_tier
from tests.helpers import OPS, assert_close, call_recurrent, call_reference, gpu, make_inputs

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def _gluon(stages=None, programs_per_sm=None, block_v=None):
    """Serve on the sm_90 decode only, small problems included, with the plan's overrides."""
    saved = (gluon_recurrent.MIN_STATE_BYTES, gluon_recurrent.SERVE_FP32, gluon_recurrent.STAGES,
             gluon_recurrent.PROGRAMS_PER_SM, gluon_recurrent.BLOCK_V)
    gluon_recurrent.MIN_STATE_BYTES, gluon_recurrent.SERVE_FP32 = 0, True
    gluon_recurrent.STAGES, gluon_recurrent.PROGRAMS_PER_SM, gluon_recurrent.BLOCK_V = stages, programs_per_sm, block_v
    try:
        with use_tier("gluon", strict=True), torch.no_grad():
            yield
    finally:
        (gluon_recurrent.MIN_STATE_BYTES, gluon_recurrent.SERVE_FP32, gluon_recurrent.STAGES,
         gluon_recurrent.PROGRAMS_PER_SM, gluon_recurrent.BLOCK_V) = saved


def _poison_allocator(nbytes: int) -> None:
    """Freed NaN blocks for the op's output allocations to reuse."""
    junk = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    del junk


def _inputs(spec, N, HV, K, V, v_first, seed):
    return make_inputs(spec, B=N, T=1, H=2 if spec.gva else HV, HV=HV, K=K, V=V, v_first=v_first, device="cuda",
                       seed=seed)


@gpu
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("stages,programs", [(None, None), (2, 1), (4, 1)])
def test_fla_form(op, v_first, stages, programs):
    """A separate fp32 initial state in, a new final state out; 300 sequences x 4 heads x 2 tiles over
    132 or 264 programs (several tiles each, a ragged last round)."""
    spec = OPS[op]
    t = _inputs(spec, N=300, HV=4, K=128, V=128, v_first=v_first, seed=1)
    _poison_allocator(t["initial_state"].numel() * 8)
    with _gluon(stages, programs):
        o, ht = call_recurrent(spec, t, output_final_state=True, state_v_first=v_first)
    ro, rht = call_reference(spec, {n: x.double() for n, x in t.items()}, output_final_state=True,
                             state_v_first=v_first)
    assert_close("o", o, ro, 2e-5)
    assert_close("ht", ht, rht, 2e-5)


@gpu
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("state_dtype,K,V,block_v", [
    (torch.float32, 128, 128, None), (torch.bfloat16, 128, 128, None), (torch.bfloat16, 128, 128, 128),
    (torch.float32, 64, 128, 32), (torch.bfloat16, 128, 64, None)])     # (128-column fp32 tiles do not fit)
@pytest.mark.parametrize("programs", [1, None], ids=["1-program", "plan"])
def test_pool_in_place(op, state_dtype, v_first, K, V, block_v, programs):
    """The pool updated in place: live slots equal the reference from their start state, skipped
    rows' slots and the slots no row names bit-identical, skipped rows' outputs zero. ``plan``:
    the shipped programs per SM (three for bf16 states: several tiles each, 260 rows x 4 heads)."""
    if programs is None and block_v is not None:
        pytest.skip("an override width: three programs of 128 bf16 columns do not fit an SM (check_plan)")
    spec = OPS[op]
    N, HV, slots = 260, 4, 600
    t = _inputs(spec, N=N, HV=HV, K=K, V=V, v_first=v_first, seed=2)
    del t["initial_state"]
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (slots, HV, V, K) if v_first else (slots, HV, K, V)
    pool = torch.randn(*shape, device="cuda", generator=gen).to(state_dtype)
    idx = torch.randperm(slots, device="cuda", generator=gen)[:N].to(torch.int32)
    idx[::7] = -1
    before = pool.clone()
    _poison_allocator(N * HV * V * 4)
    with _gluon(programs_per_sm=programs, block_v=block_v):
        o, returned = call_recurrent(spec, {**t, "initial_state": pool}, ssm_state_indices=idx, state_v_first=v_first)
    assert returned is pool
    live = idx >= 0
    start = before[idx[live].long()].double()
    ref_t = {n: x[live].double() for n, x in t.items()}
    ro, rht = call_reference(spec, {**ref_t, "initial_state": start}, output_final_state=True,
                             state_v_first=v_first)
    tol = 5e-3 if state_dtype == torch.bfloat16 else 2e-5
    assert_close("o", o[live], ro, tol)
    assert_close("pool", pool[idx[live].long()], rht, tol)
    assert torch.equal(o[~live], torch.zeros_like(o[~live]))
    untouched = torch.ones(slots, dtype=torch.bool, device="cuda")
    untouched[idx[live].long()] = False
    assert torch.equal(pool[untouched], before[untouched])


@gpu
@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_gates_in_op_varlen_single_tokens(op):
    """Gate (A_log, dt_bias, lower_bound), beta sigmoid with negative eigenvalues and l2norm in
    the op, GVA 4, one-token sequences packed through cu_seqlens (with cu_seqlens_cpu)."""
    from fastla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule
    from fastla.ops.kda import fused_recurrent_kda, naive_recurrent_kda

    N, H, HV, K, V = 200, 2, 8, 128, 128
    channel = op == "kda"
    gen = torch.Generator(device="cuda").manual_seed(4)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    t = {"q": r(1, N, H, K).bfloat16(), "k": r(1, N, H, K).bfloat16(), "v": r(1, N, HV, V).bfloat16(),
         "g": r(1, N, HV, K) if channel else r(1, N, HV), "beta": r(1, N, HV),
         "initial_state": r(N, HV, K, V), "A_log": r(HV) * 0.5, "dt_bias": r(HV * K if channel else HV)}
    cu_host = list(range(N + 1))
    opts = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=True, output_final_state=True,
                cu_seqlens=torch.tensor(cu_host, device="cuda"), cu_seqlens_cpu=torch.tensor(cu_host))
    cases = [dict()] if not channel else [dict(), dict(lower_bound=-5.0), dict(lower_bound=-2.0, A_log=None)]
    for extra in cases:
        args = {**t, **extra}
        _poison_allocator(N * HV * K * V * 4)
        with _gluon():
            o, ht = (fused_recurrent_kda if channel else fused_recurrent_gated_delta_rule)(**args, **opts)
        ref = {n: (x.double() if torch.is_tensor(x) else x) for n, x in args.items()}
        q, k, v = ref.pop("q"), ref.pop("k"), ref.pop("v")
        ref_opts = {n: x for n, x in opts.items() if n != "cu_seqlens_cpu"}
        ro, rht = (naive_recurrent_kda if channel else naive_recurrent_gated_delta_rule)(q, k, v, **ref, **ref_opts)
        assert_close(f"o {extra}", o, ro, 5e-3)                           # a bf16 output
        assert_close(f"ht {extra}", ht, rht, 2e-5)


@gpu
def test_served_and_handed_over():
    """A large bf16 pool reaches the sm_90 decode; fp32 states, small pools and multi-token calls go
    to the Triton kernel with a reason."""
    from fastla.core.validation import build_problem

    spec = OPS["gdn"]

    def problem(N, T, state_dtype):
        t = make_inputs(spec, B=1, T=N * T, H=2, HV=32, K=128, V=128, device="cuda", seed=5, h0=False)
        pool = torch.zeros(2 * N, 32, 128, 128, device="cuda", dtype=state_dtype)
        cu = list(range(0, N * T + 1, T))
        return build_problem("fused_recurrent_gated_delta_rule", q=t["q"], k=t["k"], v=t["v"], g=t["g"],
                             beta=t["beta"], delta=True, gva=True, initial_state=pool,
                             ssm_state_indices=torch.arange(N, device="cuda", dtype=torch.int32),
                             cu_seqlens=torch.tensor(cu, device="cuda"), cu_seqlens_cpu=torch.tensor(cu))

    assert gluon_recurrent.supports(problem(256, 1, torch.bfloat16)) is None
    assert "fp32 state" in gluon_recurrent.supports(problem(256, 1, torch.float32))
    assert "MB of state" in gluon_recurrent.supports(problem(16, 1, torch.bfloat16))
    assert "more than one token" in gluon_recurrent.supports(problem(64, 2, torch.bfloat16))
