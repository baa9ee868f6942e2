"""The Gluon (sm_90) GDN chunked forward against the fp64 reference and the Triton tier, on an
H200-class GPU only (bf16 inputs: the Gluon scan's tiles; the CPU suite skips this file)."""
import pytest
import torch

from fastla.bench.host_stub import split_views
from fastla.core.dispatch import use_tier
from fastla.ops.gated_delta_rule import chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
from tests.helpers import OPS, call_chunk, call_reference, make_inputs, poison, rel_rms

SPEC = OPS["gdn"]
sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not sm90, reason="needs an sm_90 GPU")]


def on(tier, fn, *args, **kwargs):
    poison()
    with use_tier(tier, strict=True), torch.no_grad():
        return fn(*args, **kwargs)


def check(t, **opts):
    """Gluon's error vs fp64 within 1.5x the Triton tier's (same prologue) plus a floor, no NaN,
    and repeat runs bit-identical (a moving error is a race)."""
    out = on("gluon", call_chunk, SPEC, t, output_final_state=True, **opts)
    again = on("gluon", call_chunk, SPEC, t, output_final_state=True, **opts)
    tri = on("triton", call_chunk, SPEC, t, output_final_state=True, **opts)
    opts.pop("cu_seqlens_cpu", None)
    ref = call_reference(SPEC, {n: x.double() for n, x in t.items()}, output_final_state=True, **opts)
    for name, g, a, r, tr in zip(("o", "final_state"), out, again, ref, tri):
        assert torch.equal(g, a), f"{name}: two runs differ (race)"
        err, err_t = rel_rms(g, r), rel_rms(tr, r)
        assert err <= 1.5 * err_t + 2e-3, f"{name}: gluon {err:.2e} vs triton {err_t:.2e}"


def bf16_inputs(**kw):
    return make_inputs(SPEC, dtype=torch.bfloat16, device="cuda", **kw)


@pytest.fixture(params=[(32, ""), (64, ""), (128, ""), (32, "ws"), (64, "ws"), (32, "dual"), (64, "dual"),
                        (128, "dual"), (64, "regs"), (128, "regs")],
                ids=["bv32", "bv64", "bv128", "ws-bv32", "ws-bv64", "dual-bv32", "dual-bv64", "dual-bv128", "regs",
                     "regs2"])
def block_v(request, monkeypatch):
    """The scan's tile width, the warp-specialized scan (chunk_delta_ws_sm90.py), the two-chain
    scan (chunk_delta_dual_sm90.py) at their widths, and the state-in-registers scan
    (chunk_delta_regs_sm90.py; its segment summaries on the two-chain scan)."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    width, kernel = request.param
    monkeypatch.setattr(gluon_chunk, "SCAN_BLOCK_V", width)
    monkeypatch.setattr(gluon_chunk, "SCAN_SPECIALIZED", kernel == "ws")
    monkeypatch.setattr(gluon_chunk, "SCAN_DUAL", kernel in ("dual", "regs"))
    monkeypatch.setattr(gluon_chunk, "SCAN_REGS", kernel == "regs")
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", 2 if kernel == "regs" and width == 128 else 1)
    return width


@pytest.mark.parametrize("T", [1, 63, 64, 65, 128, 200])    # 128: the length-specialized twins (launch.py)
def test_lengths(T, block_v):
    check(bf16_inputs(B=64 if T == 1 else 2, T=T, H=2, HV=4, K=128, V=128))   # >= 64 rows (see below)


@pytest.mark.parametrize("K,V", [(64, 64), (128, 96), (64, 128)])
def test_head_dims(K, V):
    check(bf16_inputs(B=1, T=300, H=1, HV=2, K=K, V=V))


@pytest.mark.parametrize("block_v_64", [32, 64, "dual-64", "regs-64"])
def test_head_dims_64_all_widths(block_v_64, monkeypatch):
    """K = V = 64 at both widths that divide V (the plan alone picks 32 at these few lanes), and
    64 on the two-chain and the state-in-registers scans."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    monkeypatch.setattr(gluon_chunk, "SCAN_REGS", block_v_64 == "regs-64")
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", 1)
    monkeypatch.setattr(gluon_chunk, "SCAN_DUAL", block_v_64 == "dual-64")
    monkeypatch.setattr(gluon_chunk, "SCAN_BLOCK_V", block_v_64 if isinstance(block_v_64, int) else 64)
    check(bf16_inputs(B=1, T=300, H=1, HV=2, K=64, V=64))


def test_varlen(block_v):
    lengths = [1, 63, 64, 65, 130, 7, 300]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    check(bf16_inputs(B=1, T=sum(lengths), H=2, HV=8, K=128, V=128, N=len(lengths)),
          cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)


def test_varlen_order_does_not_change_results(block_v, monkeypatch):
    """Whole varlen sequences scanned longest first (the default) and in the given order: the
    same programs, so bit-identical outputs and final states."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    lengths = [1, 63, 300, 64, 65, 130, 7, 300, 200]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = bf16_inputs(B=1, T=sum(lengths), H=2, HV=8, K=128, V=128, N=len(lengths))
    opts = dict(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu, output_final_state=True)
    longest_first = on("gluon", call_chunk, SPEC, t, **opts)
    monkeypatch.setattr(gluon_chunk, "LONGEST_FIRST", False)
    given = on("gluon", call_chunk, SPEC, t, **opts)
    for name, a, b in zip(("o", "final_state"), longest_first, given):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


@pytest.mark.parametrize("v_first", [False, True])
def test_segments(v_first, block_v, monkeypatch):
    from fastla.backends.triton import chunk_delta
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: chunk_delta.ChunkConfig(segment_chunks=2))
    lengths = [1, 300, 64, 129]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = bf16_inputs(B=1, T=sum(lengths), H=1, HV=2, K=128, V=128, N=len(lengths), v_first=v_first)
    check(t, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu, state_v_first=v_first)


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("width", [32, 64, 128])
def test_segment_summaries_on_sm90(v_first, width, monkeypatch):
    """The segment summary pass on the two-chain scan (SUMMARY_SM90; its SEG 1 over the V + K
    columns) as well as the replays, at each width, 2-chunk segments over a varlen batch."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.triton import chunk_delta
    monkeypatch.setattr(gluon_chunk, "SUMMARY_SM90", True)
    monkeypatch.setattr(gluon_chunk, "SCAN_BLOCK_V", width)
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: chunk_delta.ChunkConfig(segment_chunks=2))
    lengths = [1, 300, 64, 129]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = bf16_inputs(B=1, T=sum(lengths), H=1, HV=2, K=128, V=128, N=len(lengths), v_first=v_first)
    check(t, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu, state_v_first=v_first)


SCORES_CASES = {
    # name: (inputs, op options)
    "dense": (dict(B=2, T=200, H=2, HV=8, K=128, V=128), {}),
    "varlen": (dict(B=1, T=630, H=2, HV=8, K=128, V=128, N=7), "varlen"),
    "k64-no-gva": (dict(B=1, T=300, H=2, HV=2, K=64, V=64), {}),
    "everything-in-op": (dict(B=1, T=200, H=2, HV=4, K=128, V=128), "in-op"),
    "strong-decay": (dict(B=2, T=200, H=1, HV=2, K=128, V=128, strength=30.0), {}),
}


def _compare_prologue_kernel(monkeypatch, sm90, triton_name, switch, tol, shape, opts):
    """The op with an sm_90 prologue kernel (module ``sm90``, the default) and with the Triton one
    (chunk_prepare.``triton_name``; gluon/chunk_delta.``switch`` off), each under the fp64 check;
    then what each launch wrote, its arguments from index 6 on as named by ``tol`` (their relative
    RMS bounds), compared (finite, and no error confined to a few rows). ``opts``: op options, or
    "varlen" (sequence offsets) or "in-op" (the gate, beta and l2norm in the op)."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.triton import chunk_prepare
    from fastla.core import call_plan
    monkeypatch.setattr(call_plan, "ENABLED", False)
    seen = {}

    def recorded(fn, tag):
        def launch(*args, **kwargs):
            fn(*args, **kwargs)
            seen.update({tag + n: x.clone() if x is not None else None for n, x in zip(tol, args[6:])})
        return launch

    monkeypatch.setattr(sm90, "launch", recorded(sm90.launch, "sm90-"))
    monkeypatch.setattr(chunk_prepare, triton_name, recorded(getattr(chunk_prepare, triton_name), ""))
    t = bf16_inputs(**shape)
    if opts == "varlen":
        lengths = [1, 63, 64, 65, 130, 7, 300]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        opts = dict(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    elif opts == "in-op":
        HV = shape["HV"]
        t["g"] = torch.randn_like(t["g"])
        t["beta"] = torch.randn_like(t["beta"])
        t["q"] = t["q"] * 3.0
        opts = dict(use_gate_in_kernel=True, A_log=(torch.randn(HV) * 0.5).cuda(), dt_bias=torch.randn(HV).cuda(),
                    use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    check(t, **opts)                                        # the sm_90 kernel (the default)
    monkeypatch.setattr(gluon_chunk, switch, False)
    check(t, **opts)                                        # the Triton one
    for name, bound in tol.items():
        ref, x = seen[name], seen["sm90-" + name]
        if ref is None:
            assert x is None, name
            continue
        x, ref = x.float(), ref.float()
        assert torch.isfinite(x).all(), name
        assert rel_rms(x, ref) <= bound, f"{name}: {rel_rms(x, ref):.2e}"
        err = (x - ref).abs().max()                         # no error confined to a few rows
        assert err <= 2e-2 * ref.abs().max(), f"{name}: max error {err:.3e}"


@pytest.mark.parametrize("case", list(SCORES_CASES))
def test_sm90_scores_match_triton(case, monkeypatch):
    """The sm_90 scores kernel's scores and norms (chunk_scores_sm90.py) against the Triton scores
    kernel's (chunk_prepare.py) on the same inputs, and the whole op against fp64 with each (check),
    the scores kernel run wherever the scan would form them (SCORES_IN_SCAN off)."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.gluon import chunk_scores_sm90 as sm90
    monkeypatch.setattr(gluon_chunk, "SCORES_IN_SCAN", False)
    _compare_prologue_kernel(monkeypatch, sm90, "launch_scores", "GDN_SCORES_SM90",
                             dict(S=5e-3, rq=1e-5, rk=1e-5), *SCORES_CASES[case])


INVERSE_CASES = {
    # name: (inputs, op options, value heads a program)
    "dense": (dict(B=2, T=200, H=2, HV=8, K=128, V=128), {}, 1),
    "dense-4-heads-a-program": (dict(B=2, T=200, H=2, HV=8, K=128, V=128), {}, 4),
    "varlen-2-heads-a-program": (dict(B=1, T=630, H=2, HV=8, K=128, V=128, N=7), "varlen", 2),
    "k64-no-gva": (dict(B=1, T=300, H=2, HV=2, K=64, V=64), {}, 1),
    "everything-in-op": (dict(B=1, T=200, H=2, HV=4, K=128, V=128), "in-op", 2),
    "strong-decay": (dict(B=2, T=200, H=1, HV=2, K=128, V=128, strength=30.0), {}, 2),
}


@pytest.mark.parametrize("build", ["default", "exp2", "direct", "exp2-direct"])
@pytest.mark.parametrize("case", list(INVERSE_CASES))
def test_sm90_inverse_matches_triton(case, build, monkeypatch):
    """The sm_90 inverse kernel's P and G (chunk_inverse_sm90.py) against the Triton inverse
    kernel's (chunk_prepare.py) on the same inputs, and the whole op against fp64 with each (check);
    the default build, A's exponentials on ex2.approx.ftz (gluon/chunk_delta.INVERSE_EXP2), the
    merges' operands converted once (INVERSE_DIRECT_OPERANDS), and both. Both write P (BETA_IN_P
    off: where the scan forms the scores, the sm_90 one would write P diag(beta), which
    test_scores_in_scan checks against fp64)."""
    import dataclasses

    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.gluon import chunk_inverse_sm90 as sm90
    from fastla.backends.triton import chunk_delta, chunk_prepare
    monkeypatch.setattr(gluon_chunk, "BETA_IN_P", False)
    monkeypatch.setattr(gluon_chunk, "INVERSE_EXP2", "exp2" in build)
    monkeypatch.setattr(gluon_chunk, "INVERSE_DIRECT_OPERANDS", "direct" in build)
    shape, opts, heads = INVERSE_CASES[case]
    monkeypatch.setattr(chunk_prepare, "INVERSE_PROGRAMS_PER_SM", 0)     # the heads a program asked for
    original = chunk_delta.default_config
    monkeypatch.setattr(chunk_delta, "default_config",
                        lambda p, **kw: dataclasses.replace(original(p, **kw), inverse_heads=heads))
    _compare_prologue_kernel(monkeypatch, sm90, "launch", "GDN_INVERSE_SM90", dict(G=1e-5, P=1e-2), shape, opts)


@pytest.fixture(params=[0, 1, 2], ids=["two-chain", "regs", "regs2"])
def regs_scan(request, monkeypatch):
    """The two-chain scan, and the state-in-registers scan wherever it serves (SCAN_REGS), one and
    two chains a program (forced: the plan gives these few-lane shapes the two-chain scan)."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    monkeypatch.setattr(gluon_chunk, "SCAN_REGS", request.param > 0)
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", max(request.param, 1))


def test_no_initial_state_and_strong_decay(regs_scan):
    check(bf16_inputs(B=2, T=200, H=1, HV=2, K=128, V=128, h0=False, strength=30.0))


def test_everything_in_op(regs_scan):
    torch.manual_seed(0)
    B, T, H, HV, K, V = 1, 200, 2, 4, 128, 128
    t = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
             g=torch.randn(B, T, HV), beta=torch.randn(B, T, HV), initial_state=torch.randn(B, HV, K, V))
    t = {n: (x.cuda() if n == "initial_state" else x.cuda().bfloat16()) for n, x in t.items()}
    opts = dict(use_gate_in_kernel=True, A_log=(torch.randn(HV) * 0.5).cuda(), dt_bias=torch.randn(HV).cuda(),
                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                output_final_state=True)
    o, ht = on("gluon", chunk_gated_delta_rule, **t, **opts)
    to, tht = on("triton", chunk_gated_delta_rule, **t, **opts)
    d = {n: x.double() for n, x in t.items()}
    q, k, v = d.pop("q"), d.pop("k"), d.pop("v")
    ro, rht = naive_recurrent_gated_delta_rule(q, k, v, **d, **opts)
    assert rel_rms(o, ro) <= 1.5 * rel_rms(to, ro) + 2e-3
    assert rel_rms(ht, rht) <= 1.5 * rel_rms(tht, rht) + 2e-3


@pytest.mark.parametrize("in_place", [False, True], ids=["copies", "strided-tma"])
def test_strided_and_misaligned_inputs(in_place, regs_scan, monkeypatch):
    """q, k, v split from one projection (the layout models pass), a strided gate, beta and state,
    then a contiguous q at a 2-byte offset: the Gluon tier serves them (through dense, 16-byte
    aligned copies, or with STRIDED_TMA the split q, k, v read in place) with the contiguous
    inputs' results, bit for bit."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    monkeypatch.setattr(gluon_chunk, "STRIDED_TMA", in_place)
    kept, real = [], gluon_chunk.in_place_views
    monkeypatch.setattr(gluon_chunk, "in_place_views", lambda p: kept.append(real(p)) or kept[-1])
    B, T, H, HV, K, V = 2, 200, 2, 4, 128, 128
    t = bf16_inputs(B=B, T=T, H=H, HV=HV, K=K, V=V)
    split = split_views(t)
    buf = torch.empty(t["q"].numel() + 1, dtype=t["q"].dtype, device="cuda")
    misaligned = buf[1:].view_as(t["q"]).copy_(t["q"])
    opts = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    want = on("gluon", call_chunk, SPEC, t, **opts)
    for case, inputs in (("split", split), ("misaligned", dict(t, q=misaligned))):
        got = on("gluon", call_chunk, SPEC, inputs, **opts)
        for name, a, b in zip(("o", "final_state"), got, want):
            assert torch.equal(a, b), f"{case}: {name} differs from the contiguous inputs' run"
    assert (("q", "k", "v") in kept) == in_place, kept                  # the split views read in place


def test_offsets_on_the_host_only():
    """Offsets given only as cu_seqlens_cpu: the varlen batch it describes, as with both given."""
    lengths = [70, 1, 300]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = bf16_inputs(B=1, T=sum(lengths), H=2, HV=4, K=128, V=128, N=len(lengths))
    host_only = on("gluon", call_chunk, SPEC, t, output_final_state=True, cu_seqlens_cpu=cu)
    both = on("gluon", call_chunk, SPEC, t, output_final_state=True, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    for name, a, b in zip(("o", "final_state"), host_only, both):
        assert torch.equal(a, b), f"{name} differs with the offsets on the host only"


@pytest.mark.parametrize("T", [200, 400])      # (400: a multiple of 16, the length-specialized twins)
def test_intermediate_states_match_triton(T, block_v):
    t = bf16_inputs(B=2, T=T, H=1, HV=2, K=128, V=128)
    opts = dict(output_final_state=True, return_intermediate_states=True)
    o, ht, h = on("gluon", call_chunk, SPEC, t, **opts)
    to, tht, th = on("triton", call_chunk, SPEC, t, **opts)
    assert h.shape == th.shape
    assert rel_rms(h.float(), th.float()) <= 1e-2
    assert rel_rms(o.float(), to.float()) <= 1e-2


def test_fewer_than_64_tokens_go_to_triton():
    """A batch of fewer than 64 tokens (fewer rows than the scan's 64-row TMA boxes, not validated on
    the GPU) is served by the Triton tier, with the reason logged."""
    from fastla.core import dispatch
    from fastla.core.validation import build_problem
    t = bf16_inputs(B=2, T=1, H=1, K=128, V=128)
    problem = build_problem("chunk_gated_delta_rule", q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"],
                            delta=True, gva=True)
    assert "64 rows" in dict(dispatch.explain("chunk_gated_delta_rule", problem))["gluon"]


def test_gluon_serves_by_default():
    from fastla.core import dispatch
    from fastla.core.validation import build_problem
    t = bf16_inputs(B=1, T=64, H=1, K=128, V=128)
    problem = build_problem("chunk_gated_delta_rule", q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"],
                            delta=True, gva=True)
    assert dict(dispatch.explain("chunk_gated_delta_rule", problem))["gluon"] is None


@pytest.mark.parametrize("pieces", [2, 5])
@pytest.mark.parametrize("v_first", [False, True])
def test_pipeline_pieces(pieces, v_first, monkeypatch):
    """GDN's pipeline (chunk_delta._run_pipelined: each piece's prologue on a side stream, its scan
    after the piece's event, the state carried between pieces): the output and final state equal
    the unpipelined call's on the same one-chain scan bit for bit, within the fp64 check, and two
    runs agree (a missing wait would read a piece's P or scores before they are written). Pieces
    read their scores from the scores kernel, so the whole call is held to that kernel too
    (SCORES_IN_SCAN off): the scan's own Q K^T rounds differently."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    t = bf16_inputs(B=1, T=64 * 9 + 30, H=2, HV=8, K=128, V=128, v_first=v_first)
    opts = dict(output_final_state=True, state_v_first=v_first)
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", 1)
    monkeypatch.setattr(gluon_chunk, "SCORES_IN_SCAN", False)
    monkeypatch.setattr(gluon_chunk, "PIPELINE_PIECES", 1)
    whole = on("gluon", call_chunk, SPEC, t, **opts)
    monkeypatch.setattr(gluon_chunk, "PIPELINE_PIECES", pieces)
    check(t, state_v_first=v_first)
    piped = on("gluon", call_chunk, SPEC, t, **opts)
    for name, a, b in zip(("o", "final_state"), whole, piped):
        assert torch.equal(a, b), f"{name}: pipelined differs from whole ({(a.float() - b.float()).abs().max()})"


def test_pipeline_split_projection_and_offsets(monkeypatch):
    """The pipeline over q, k, v split from one projection (the pieces' views of them read in place
    by TMA, STRIDED_TMA) and over offsets [0, T] (a packed batch of one sequence: the pieces drop
    them): the contiguous dense call's output and final state, bit for bit."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    monkeypatch.setattr(gluon_chunk, "PIPELINE_PIECES", 3)
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", 1)
    T = 64 * 9 + 30
    t = bf16_inputs(B=1, T=T, H=2, HV=8, K=128, V=128)
    want = on("gluon", call_chunk, SPEC, t, output_final_state=True)
    cu = torch.tensor([0, T])
    for got in (on("gluon", call_chunk, SPEC, split_views(t), output_final_state=True),
                on("gluon", call_chunk, SPEC, t, output_final_state=True, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)):
        for name, a, b in zip(("o", "final_state"), want, got):
            assert torch.equal(a, b), name


def test_pipeline_in_a_graph(monkeypatch):
    """The pipeline captured in a CUDA graph (the side stream forked and joined inside the capture)
    replays to the eager call's output, on new inputs copied into the captured ones."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    monkeypatch.setattr(gluon_chunk, "PIPELINE_PIECES", 3)
    t = bf16_inputs(B=1, T=64 * 8, H=2, HV=8, K=128, V=128)
    u = bf16_inputs(B=1, T=64 * 8, H=2, HV=8, K=128, V=128)
    want = on("gluon", call_chunk, SPEC, u, output_final_state=True)
    graph = torch.cuda.CUDAGraph()
    with use_tier("gluon", strict=True), torch.no_grad():
        call_chunk(SPEC, t, output_final_state=True)
        with torch.cuda.graph(graph):
            out = call_chunk(SPEC, t, output_final_state=True)
    for name in t:
        t[name].copy_(u[name])
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("o", "final_state"), want, out):
        assert torch.equal(a, b), name


L2 = dict(use_qk_l2norm_in_kernel=True)


def varlen_inputs(opts: dict, lengths=(70, 1, 300, 64, 129)) -> dict:
    """A varlen batch of ``lengths`` (a length-1 sequence among them), its offsets added to ``opts``."""
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    opts.update(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    return bf16_inputs(B=1, T=sum(lengths), H=2, HV=4, K=128, V=128, N=len(lengths))
SCORES_IN_SCAN_CASES = {
    # name: (inputs, options); the scan's chains forced (REGS_CHAINS), no segments at these lengths
    "lengths": (dict(B=2, T=200, H=2, HV=4, K=128, V=128), L2),
    "one-chunk-and-a-row": (dict(B=3, T=65, H=2, HV=4, K=128, V=128), L2),
    "no-l2norm-v-first": (dict(B=2, T=200, H=1, HV=2, K=128, V=128, v_first=True), dict(state_v_first=True)),
    "strong-decay": (dict(B=2, T=200, H=1, HV=2, K=128, V=128, h0=False, strength=30.0), L2),
    "k64": (dict(B=2, T=200, H=2, HV=4, K=64, V=64), L2),
    "varlen": ("varlen", L2),
    "everything-in-op": ("gated", {}),
}


@pytest.mark.parametrize("chains", [1, 2])
@pytest.mark.parametrize("case", list(SCORES_IN_SCAN_CASES))
def test_scores_in_scan(case, chains, monkeypatch):
    """GDN's scores formed in the state-in-registers scan (SCORES_IN_SCAN: no scores kernel; the
    inverse kernel writes 1 / |q| and 1 / |k|), one chain and two (the second forms them for both;
    K = V = 64 runs one): within the fp64 check, bit-stable over runs, close to the scores
    kernel's call (both round the scores to bf16), and the scores kernel never launched."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.gluon import chunk_scores_sm90
    from tests.helpers import gated_case
    shape, opts = SCORES_IN_SCAN_CASES[case]
    opts = dict(opts)
    if shape == "varlen":
        t = varlen_inputs(opts)
    elif shape == "gated":
        t, extra, gated = gated_case("gdn", B=2, T=200, device="cuda")
        t = {n: (x if n == "initial_state" else x.bfloat16()) for n, x in t.items()}
        opts.update(gated, **extra)
    else:
        t = bf16_inputs(**shape)
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", chains)
    launches = []
    real = chunk_scores_sm90.launch
    monkeypatch.setattr(chunk_scores_sm90, "launch", lambda *a, **k: launches.append(1) or real(*a, **k))
    monkeypatch.setattr(gluon_chunk, "SCORES_IN_SCAN", False)
    kernel_call = on("gluon", call_chunk, SPEC, t, output_final_state=True, **opts)
    assert launches, "the scores kernel ran with the flag off"
    monkeypatch.setattr(gluon_chunk, "SCORES_IN_SCAN", True)
    launches.clear()
    check(t, **opts)
    assert not launches, "the scores kernel ran with the scores formed in the scan"
    in_scan = on("gluon", call_chunk, SPEC, t, output_final_state=True, **opts)
    for name, a, b in zip(("o", "final_state"), in_scan, kernel_call):
        assert rel_rms(a, b) <= 1e-2, f"{name}: {rel_rms(a, b):.2e} from the scores kernel's call"
