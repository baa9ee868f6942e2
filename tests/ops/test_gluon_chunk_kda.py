"""The Gluon tier's KDA chunked forward (the Triton prologue, the sm_90 scan's per-channel GK
step) against the fp64 reference on an sm_90 GPU, every option as the registry uses it."""
import dataclasses

import pytest
import torch

from fastla.backends.gluon import available
from tests.helpers import assert_close, call_chunk, strided_inputs
from tests.ops.test_triton_chunk_kda import SPEC, bf16_case, check_fp64, on_tier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or available(torch.device("cuda")) is not None, reason="needs an sm_90 GPU")]


@pytest.mark.parametrize("case", ["dense", "varlen", "strong-decay", "unbounded-gate", "bounded-gate",
                                  "v-first-k64", "bounded-varlen", "bounded-k64", "bounded-plain"])
def test_bf16_cases(case):
    check_fp64(*bf16_case(case), tier="gluon")


@pytest.mark.parametrize("case", ["bounded-gate", "varlen", "v-first-k64", "bounded-varlen"])
@pytest.mark.parametrize("block_v", [32, 64, "dual-32", "dual-64"])
def test_tile_widths(block_v, case, monkeypatch):
    """Both widths (the small test shapes plan 32 columns by themselves), on the plain and the
    two-chain scan (chunk_delta_dual_sm90.py)."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    dual = str(block_v).startswith("dual-")
    monkeypatch.setattr(gluon_chunk, "SCAN_DUAL", dual)
    monkeypatch.setattr(gluon_chunk, "SCAN_BLOCK_V", int(block_v[5:]) if dual else block_v)
    check_fp64(*bf16_case(case), tier="gluon")


@pytest.mark.parametrize("chains", [1, 2])
@pytest.mark.parametrize("case", ["dense", "varlen", "strong-decay", "unbounded-gate", "bounded-gate",
                                  "v-first-k64", "bounded-varlen", "bounded-k64"])
def test_state_in_registers_scan(case, chains, monkeypatch):
    """The state-in-registers scan (chunk_delta_regs_sm90.py, SCAN_REGS) on every gate and layout,
    one and two chains a program (two: V = 128 only; K = V = 64 runs one), then with segment
    replays (4-chunk segments; the summaries on the two-chain scan)."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.triton import chunk_delta
    monkeypatch.setattr(gluon_chunk, "SCAN_REGS", True)
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", chains)
    check_fp64(*bf16_case(case), tier="gluon")
    if case in ("varlen", "bounded-gate"):
        original = chunk_delta.default_config
        monkeypatch.setattr(chunk_delta, "default_config",
                            lambda p, **kw: dataclasses.replace(original(p, **kw), segment_chunks=4))
        check_fp64(*bf16_case(case), tier="gluon")


@pytest.mark.parametrize("packed", [False, True], ids=["fp32-products", "bf16-pairs"])
@pytest.mark.parametrize("case", ["bounded-gate", "bounded-gate-whole", "bounded-varlen", "bounded-k64",
                                  "bounded-plain", "bounded-neg-eigval"])
def test_gates_in_scan(case, packed, monkeypatch):
    """KDA's gated keys and queries formed in the scan (GATES_IN_SCAN: the gater warpgroup of the
    one-chain state-in-registers scan; the prologue stores no kg, kd nor qg) on the bounded gate:
    planned, with outputs poisoned first within the fp64 check, equal over two runs, and close to
    the call that reads the prologue's gated tiles (both round them to bf16); with the gaters'
    products on fp32 and on bf16 pairs (GATER_PACKED, shipped)."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from tests.helpers import poison, rel_rms
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", 1)      # (the small shapes plan the other scans)
    monkeypatch.setattr(gluon_chunk, "GATER_PACKED", packed)
    planned = []
    real = gluon_chunk.gates_in_scan
    monkeypatch.setattr(gluon_chunk, "gates_in_scan", lambda p, c: planned.append(real(p, c)) or planned[-1])
    t, opts = bf16_case(case)
    monkeypatch.setattr(gluon_chunk, "GATES_IN_SCAN", False)
    tiles = on_tier(call_chunk, SPEC, t, tier="gluon", output_final_state=True, **opts)
    assert planned == [False]
    monkeypatch.setattr(gluon_chunk, "GATES_IN_SCAN", True)
    poison()
    check_fp64(t, opts, tier="gluon")
    assert planned[-1], "the gates were not planned in the scan"
    poison()
    first = on_tier(call_chunk, SPEC, t, tier="gluon", output_final_state=True, **opts)
    poison()
    again = on_tier(call_chunk, SPEC, t, tier="gluon", output_final_state=True, **opts)
    for name, a, b, c in zip(("o", "final_state"), first, again, tiles):
        assert torch.equal(a, b), f"{name} moved between two runs"
        assert rel_rms(a, c) <= 1e-2, f"{name}: {rel_rms(a, c):.2e} from the prologue's gated tiles"


@pytest.mark.parametrize("in_place", [False, True], ids=["copies", "strided-tma"])
def test_strided_inputs(in_place, monkeypatch):
    """Strided views of every input (q, k, v, the raw gate, beta, the state, the offsets, A_log and
    dt_bias) on the Gluon tier (dense copies, 16-byte aligned for TMA), then q, k, v split from one
    projection (read in place with STRIDED_TMA): the contiguous inputs' results, bit for bit."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.bench.host_stub import split_views
    monkeypatch.setattr(gluon_chunk, "STRIDED_TMA", in_place)
    kept, real = [], gluon_chunk.in_place_views
    monkeypatch.setattr(gluon_chunk, "in_place_views", lambda p: kept.append(real(p)) or kept[-1])
    t, opts = bf16_case("bounded-varlen")
    tensors = {n: x for n, x in opts.items() if isinstance(x, torch.Tensor) and x.is_cuda}
    want = on_tier(call_chunk, SPEC, t, tier="gluon", output_final_state=True, **opts)
    got = on_tier(call_chunk, SPEC, strided_inputs(t), tier="gluon", output_final_state=True,
                  **dict(opts, **strided_inputs(tensors)))
    split = on_tier(call_chunk, SPEC, split_views(t), tier="gluon", output_final_state=True, **opts)
    for name, a, b, c in zip(("o", "final_state"), got, want, split):
        assert torch.equal(a, b), f"{name} differs with strided inputs"
        assert torch.equal(c, b), f"{name} differs with q, k, v split from one projection"
    assert (("q", "k", "v") in kept) == in_place, kept                  # the split views read in place


def test_varlen_segment_replays(monkeypatch):
    """Sequence parallelism on a varlen batch (4-chunk segments, replays in the sm_90 scan)."""
    from fastla.backends.triton import chunk_delta
    original = chunk_delta.default_config
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: dataclasses.replace(original(p, **kw), segment_chunks=4))
    check_fp64(*bf16_case("varlen"), tier="gluon")


def test_varlen_segment_summaries_on_sm90(monkeypatch):
    """As above with the summary pass on the two-chain scan too (SUMMARY_SM90, 64 columns)."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.triton import chunk_delta
    original = chunk_delta.default_config
    monkeypatch.setattr(gluon_chunk, "SUMMARY_SM90", True)
    monkeypatch.setattr(gluon_chunk, "SCAN_BLOCK_V", 64)
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: dataclasses.replace(original(p, **kw), segment_chunks=4))
    check_fp64(*bf16_case("varlen"), tier="gluon")


def test_segments_at_96_value_columns(monkeypatch):
    """V = 96 split into segments: the two-chain summary takes 64 of the V + K columns only, so
    the summaries run on the Triton scan (gluon_chunk.summaries_sm90), the replays on sm_90."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.triton import chunk_delta
    original = chunk_delta.default_config
    t, opts = bf16_case("bounded-gate")
    t = {n: x[..., :96] if n in ("v", "initial_state") else x for n, x in t.items()}
    t = {n: x.contiguous() for n, x in t.items()}
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: dataclasses.replace(original(p, **kw), segment_chunks=4))
    assert not gluon_chunk.summaries_sm90(type("P", (), dict(V=96, K=128, gk=t["g"]))())
    check_fp64(t, opts, tier="gluon")


def test_segments_and_intermediate_states(monkeypatch):
    """Segments forced on (8-chunk replays in the sm_90 scan) with the chunk-start states: output
    and final state against fp64, the states against the unsplit run."""
    from fastla.backends.triton import chunk_delta
    original = chunk_delta.default_config
    t, opts = bf16_case("bounded-gate")
    t = {n: x[:1] for n, x in t.items()}
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: dataclasses.replace(original(p, **kw), segment_chunks=0))
    (h_whole,) = check_fp64(t, opts, tier="gluon", return_intermediate_states=True)
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: dataclasses.replace(original(p, **kw), segment_chunks=8))
    (h,) = check_fp64(t, opts, tier="gluon", return_intermediate_states=True)
    check_fp64(t, opts, tier="gluon")                      # the replays at the planned width (no states)
    assert torch.isfinite(h).all()
    assert_close("h", h, h_whole, 2e-2)


BOUNDED_CASES = ["bounded-gate", "bounded-varlen", "bounded-k64", "bounded-plain", "bounded-neg-eigval",
                 "bounded-saturated"]


@pytest.mark.parametrize("case", BOUNDED_CASES)
def test_sm90_prologue_matches_triton(case, monkeypatch):
    """The sm_90 prologue's P, Aqk, gated keys and queries, kd and decays against the Triton
    prologue's on the same inputs (bounded gates; bounded-saturated holds half the channels at
    lower_bound, -5 nats a token: every block's span at its 115 log2 units)."""
    _prologue_parity(case, monkeypatch)


@pytest.mark.parametrize("case", [c for c in BOUNDED_CASES if c != "bounded-plain"])    # (FROM_X: l2norm only)
def test_sm90_prologue_bounded_operands(case, monkeypatch):
    """The bounded gate's left operands from X (chunk_prepare_kda_sm90.BOUNDED_OPERANDS: the own
    block's rows X 2^(span / 2), up to 2^57.7 |k| at bounded-saturated, q and k slices unmasked,
    so the varlen case's rows of the next sequence reach the products): the same parity."""
    from fastla.backends.gluon import chunk_prepare_kda_sm90 as sm90
    monkeypatch.setattr(sm90, "BOUNDED_OPERANDS", True)
    _prologue_parity(case, monkeypatch)


@pytest.mark.parametrize("from_x", [False, True])
@pytest.mark.parametrize("case", ["bounded-whole", "bounded-saturated-whole"])
def test_sm90_prologue_full_chunks(case, from_x, monkeypatch):
    """Whole chunks without row masks (chunk_prepare_kda_sm90.FULL_CHUNKS: a dense batch, T = 1024)
    with either form of the bounded gate's operands: the same parity, and the launch took FULL."""
    from fastla.backends.gluon import chunk_prepare_kda_sm90 as sm90
    from fastla.backends.triton import launch
    monkeypatch.setattr(sm90, "FULL_CHUNKS", True)
    monkeypatch.setattr(sm90, "BOUNDED_OPERANDS", from_x)
    full, real = [], launch.launcher

    class Spy:                                   # records the prologue's FULL at each launch
        def __init__(self, fn, *args):
            self.fn, self.runner = fn, real(fn, *args)

        def __getitem__(self, grid):
            def go(*args, **kwargs):
                if self.fn is sm90._kda_prologue_sm90_kernel:
                    full.append(kwargs["FULL"])
                return self.runner[grid](*args, **kwargs)
            return go
    monkeypatch.setattr(launch, "launcher", Spy)
    _prologue_parity(case, monkeypatch)
    assert full and all(full), full


@pytest.mark.parametrize("case", ["unbounded-gate", "dense", "dense-fp32-gate", "strong-decay", "mixed-decay",
                                  "one-wide-block", "bounded-wide"])
def test_sm90_prologue_unbounded(case, monkeypatch):
    """The softplus and the given (bf16, fp32) gates on the sm_90 prologue, the blocks with a span
    past its limit rewritten by the wide-block kernel (strength-100 decay flags most; mixed-decay
    gives two of the four heads that decay, so flagged and served chunks share a launch;
    one-wide-block one block a chunk, at every position, so rewritten entries sit next to the
    prologue's own; lower_bound -8 spans at most 185 log2 units and flags none)."""
    flags = _prologue_parity(case, monkeypatch)
    if case == "mixed-decay":
        assert flags is not None and 0 < int((flags != 0).sum()) < flags.numel(), flags
    if case == "strong-decay":
        assert flags is not None and flags.any(), flags
    if case == "one-wide-block":
        assert flags is not None and ((flags != 0) & (flags != 15)).any(), flags


@pytest.mark.parametrize("case", ["bounded-gate", "bounded-varlen", "bounded-k64", "dense-fp32-gate", "one-wide-block"])
def test_sm90_prologue_persistent(case, monkeypatch):
    """The persistent prologue on two programs, so each takes many items in turn (the q / k
    buffers and the gate's slots through many phases, the next item's loads under this one's
    products): the same parity as on a full grid."""
    from fastla.backends import triton as triton_backend
    monkeypatch.setattr(triton_backend, "sm_count", lambda device: 1)
    _prologue_parity(case, monkeypatch)


@pytest.mark.parametrize("persistent", [False, True], ids=["full-grid", "two-programs"])
@pytest.mark.parametrize("case", ["bounded-gate", "bounded-varlen", "bounded-k64"])
def test_sm90_prologue_loads_ahead(case, persistent, monkeypatch):
    """The prologue's bias a slice ahead and beta at the item's start (LOADS_AHEAD, the bounded
    gate's FROM_X builds; on two programs the next item's bias comes under this item's last
    slice): the op within the fp64 check, bit for bit the call that loads both where used."""
    from fastla.backends import triton as triton_backend
    from fastla.backends.gluon import chunk_prepare_kda_sm90 as sm90
    from tests.helpers import poison
    if persistent:
        monkeypatch.setattr(triton_backend, "sm_count", lambda device: 1)
    t, opts = bf16_case(case)
    monkeypatch.setattr(sm90, "LOADS_AHEAD", False)
    late = on_tier(call_chunk, SPEC, t, tier="gluon", output_final_state=True, **opts)
    monkeypatch.setattr(sm90, "LOADS_AHEAD", True)
    poison()
    check_fp64(t, opts, tier="gluon")
    poison()
    ahead = on_tier(call_chunk, SPEC, t, tier="gluon", output_final_state=True, **opts)
    for name, a, b in zip(("o", "final_state"), ahead, late):
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max()} from the loads where used"


@pytest.mark.parametrize("case", ["bounded-gate", "bounded-gate-whole", "bounded-varlen", "bounded-k64",
                                  "bounded-neg-eigval", "bounded-plain", "unbounded-gate"])
def test_sm90_a_scratch_fp16(case, monkeypatch):
    """A's scratch in fp16 (chunk_prepare_kda_sm90.A_FP16) on the calls that store the gated tiles
    (the small shapes plan them anyway), exactly where |A| <= 2 (a gate computed in the op, bounded
    or softplus, the l2norm and beta's sigmoid in the op; bounded-plain, without them, keeps fp32;
    unbounded-gate goes through the wide-block rewrite): the op against fp64 with outputs poisoned,
    and its error there within 5% (+1e-5) of the fp32 scratch's on the same inputs, output and
    final state."""
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.gluon import chunk_inverse_sm90
    from fastla.backends.gluon import chunk_prepare_kda_sm90 as sm90
    from tests.helpers import poison, rel_rms
    from tests.ops.test_triton_chunk_kda import fp64_reference
    monkeypatch.setattr(gluon_chunk, "GATES_IN_SCAN", False)
    scratch = []
    original = chunk_inverse_sm90.launch_kda
    monkeypatch.setattr(chunk_inverse_sm90, "launch_kda", lambda p, total, tables, a, *r, **kw:
                        scratch.append(a.dtype) or original(p, total, tables, a, *r, **kw))
    t, opts = bf16_case(case)
    ref = fp64_reference(t, opts)
    errors = {}
    for half in (True, False):
        monkeypatch.setattr(sm90, "A_FP16", half)
        poison()
        out = on_tier(call_chunk, SPEC, t, tier="gluon", output_final_state=True, **opts)
        errors[half] = [rel_rms(x, r) for x, r in zip(out, ref)]
    bounded = case != "bounded-plain"
    assert scratch == [torch.float16 if bounded else torch.float32, torch.float32], scratch
    for name, e16, e32 in zip(("o", "final_state"), errors[True], errors[False]):
        assert e16 <= 1.05 * e32 + 1e-5, f"{name}: {e16:.3e} against fp64 with the fp16 scratch, {e32:.3e} with fp32"
        assert e16 <= 2e-2, f"{name}: {e16:.3e}"


@pytest.mark.parametrize("case", ["bounded-gate", "bounded-varlen", "bounded-k64", "unbounded-gate", "strong-decay"])
def test_sm90_inverse_matches_triton(case, monkeypatch):
    """The Gluon inverse kernel (chunk_prepare_kda_sm90.INVERSE_SM90): the op against fp64, and its P
    against the Triton inverse kernel's from the same prologue (unbounded gates: A rewritten by the
    wide-block kernel first)."""
    from fastla.backends.gluon import chunk_prepare_kda_sm90 as sm90
    seen = {}

    def recorded(*args, launch=sm90.launch, **kwargs):
        launch(*args, **kwargs)
        seen[sm90.INVERSE_SM90] = args[5].clone()                       # P
    monkeypatch.setattr(sm90, "launch", recorded)
    t, opts = bf16_case(case)
    for gluon_inverse in (True, False):
        monkeypatch.setattr(sm90, "INVERSE_SM90", gluon_inverse)
        check_fp64(t, opts, tier="gluon")
    assert set(seen) == {True, False} and torch.isfinite(seen[True]).all()
    assert_close("P", seen[True].float(), seen[False].float(), 1e-2)
    err = (seen[True].float() - seen[False].float()).abs().max()       # no error confined to a few rows
    assert err <= 2e-2 * seen[False].float().abs().max(), f"P: max error {err:.3e}"


def _prologue_parity(case, monkeypatch):
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.gluon import chunk_prepare_kda_sm90 as sm90
    from fastla.backends.triton import chunk_prepare_kda, chunk_prepare_kda_wide
    seen = {}

    def recorded(name, fn, first):
        def launch(*args, **kwargs):
            fn(*args, **kwargs)
            seen[name] = [x.clone() for x in args[first:first + 6]]     # P, Aqk, kg, kd, qg, decay
        return launch

    def wide(*args, launch=chunk_prepare_kda_wide.launch):              # the block flags of the rewrite
        launch(*args)
        seen["flags"] = args[-1].clone()

    monkeypatch.setattr(chunk_prepare_kda_wide, "launch", wide)
    monkeypatch.setattr(sm90, "launch", recorded("sm90", sm90.launch, 5))
    monkeypatch.setattr(chunk_prepare_kda, "launch", recorded("triton", chunk_prepare_kda.launch, 7))
    t, opts = bf16_case("dense" if case in ("mixed-decay", "dense-fp32-gate", "one-wide-block") else case)
    if case == "mixed-decay":
        t["g"][:, :, :2] *= 100.0
    if case.startswith("bounded-saturated"):     # sigmoid(A (g + dt_bias)) ~ 1 in every other channel
        t["g"][..., ::2] += 30.0
    if case == "one-wide-block":                 # chunk c: block c % 4 decays 15 nats a token in channel 0
        for c in range(-(-t["g"].shape[1] // 64)):
            rows = slice(64 * c + 16 * (c % 4), 64 * c + 16 * (c % 4) + 16)
            t["g"][:, rows, :, 0] = -15.0
    if case == "dense-fp32-gate":
        t["g"] = t["g"].float()
    check_fp64(t, opts, tier="gluon")
    flags = seen.pop("flags", None)
    monkeypatch.setattr(gluon_chunk, "KDA_PROLOGUE_SM90", False)
    check_fp64(t, opts, tier="gluon")
    seen.pop("flags", None)
    assert set(seen) == {"sm90", "triton"}
    exact = None if "cu_seqlens" in opts else _reference_inverse(t, opts)
    for name, x, ref in zip(("P", "Aqk", "kg", "kd", "qg", "decay"), seen["sm90"], seen["triton"]):
        assert torch.isfinite(x).all(), name
        assert_close(name, x.float(), ref.float(), 1e-2)
        if name == "P" and exact is not None:
            # against fp64, entry by entry, within twice the first-order effect of bf16 operands
            # (|dA| <= 2^-8 |A|, A's sum of absolute products: |dP| <= |P| |dA| |P|) plus P's own
            # bf16 rounding; the sm_90 prologue forms A from bf16 operands but for the flagged
            # blocks (the wide-block kernel, fp32), the Triton one its wide-span diagonal blocks in fp32
            P, bound = exact
            err = (x.double() - P).abs()
            worst = (err / bound).max().item()
            assert worst <= 1.0, f"P: error {err.max().item():.3e}, {worst:.2f}x the bf16 bound"
            continue
        err = (x.float() - ref.float()).abs().max()                     # no error confined to a few rows
        assert err <= 2e-2 * ref.float().abs().max(), f"{name}: max error {err:.3e}"
    return flags


def _reference_inverse(t, opts):
    """P = (I + A)^-1 of every 64-token chunk in fp64, [B, T, HV, 64] as the prologues write it
    (dense batches), A = strict_lower(diag(beta) sum_c k_ic k_jc e^(G_ic - G_jc)), and the bound
    2 (2^-8 |P| |A|_abs |P|) + 2^-8 |P| + 2^-20 on an error from bf16 operands, where |A|_abs sums
    the products' absolute values."""
    import torch.nn.functional as F

    from fastla.backends.torch.chunked import _channel_scores_block
    from fastla.core.gates import beta_activation, kda_gate, l2norm

    k, g, beta = (t[n].double() for n in ("k", "g", "beta"))
    B, T, H, K = k.shape
    HV = g.shape[2]
    if opts.get("use_qk_l2norm_in_kernel"):
        k = l2norm(k)
    if opts.get("use_gate_in_kernel"):
        A_log, dt_bias = (opts.get(n) for n in ("A_log", "dt_bias"))
        g = kda_gate(g, A_log.double() if A_log is not None else None,
                     dt_bias.double() if dt_bias is not None else None, opts.get("lower_bound"))
    if opts.get("use_beta_sigmoid_in_kernel"):
        beta = beta_activation(beta, opts.get("allow_neg_eigval", False))
    NT = -(-T // 64)
    pad = NT * 64 - T

    def chunks(x):                                                      # [B, T, HV, *d] -> [B NT HV, 64, *d]
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)).unflatten(1, (NT, 64))
        return x.movedim(3, 2).flatten(0, 2)

    kc, gc, bc = chunks(k.repeat_interleave(HV // H, dim=2)), chunks(g).cumsum(1), chunks(beta)[..., None]
    A = _channel_scores_block(kc, kc, gc, strict=True) * bc
    A_abs = _channel_scores_block(kc.abs(), kc.abs(), gc, strict=True) * bc.abs()
    P = torch.linalg.inv(torch.eye(64, dtype=A.dtype, device=A.device) + A)
    bound = 2 * 2 ** -8 * (P.abs() @ A_abs @ P.abs()) + 2 ** -8 * P.abs() + 2 ** -20

    def rows(x):                                                        # [B NT HV, 64, 64] -> [B, T, HV, 64]
        return x.unflatten(0, (B, NT, HV)).movedim(2, 3).flatten(1, 2)[:, :T]
    return rows(P), rows(bound)
