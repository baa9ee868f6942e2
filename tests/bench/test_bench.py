"""The benchmark harness on the CPU: registry, inputs, work model, report, runner CLI, and
one tiny end-to-end record (fastla's torch tier standing in for FLA, timing faked)."""
from __future__ import annotations

import json
import math
import re
import sys
import types
from dataclasses import replace

import pytest
import torch

from fastla.bench import registry, report, runner
from fastla.bench.inputs import (
    call_kwargs, expected_shapes, flops_per_token_head, make_inputs, to_float64, with_grad, work,
)
from fastla.bench.registry import CONFIGS, get_config, parse_modes, scale_down, select_configs

NAME = re.compile(r"^[a-z_-]+/h\d+(-hv\d+)?/(\d+x\d+|varlen\d+x\d+|n\d+)$")


# ----------------------------------------------------------------------------- registry

def test_names_unique_and_stable():
    names = [c.name for c in CONFIGS]
    assert len(names) == len(set(names))
    assert all(NAME.match(n) for n in names), [n for n in names if not NAME.match(n)]
    assert "gdn/h16-hv64/1x32768" in names and "kda-decode/h32-hv32/n256" in names


def test_configs_are_consistent():
    for cfg in CONFIGS:
        assert cfg.op in registry.OPS
        assert set(cfg.modes) <= set(registry.MODES)
        assert cfg.HV % cfg.H == 0
        if cfg.lengths is not None:
            assert cfg.B == 1 and cfg.T == sum(cfg.lengths)
        assert cfg.options.get("output_final_state") is True
    kda = get_config("kda/h96/varlen8x15193")
    assert kda.lengths == (1300, 547, 2048, 963, 271, 3063, 1, 7000)
    assert kda.options["lower_bound"] == -5.0 and kda.options["safe_gate"]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_tiny_inputs_have_the_documented_shapes(cfg):
    inputs = make_inputs(cfg, "cpu", tiny=True)
    small = inputs.cfg
    assert small.T <= 80 and small.H == cfg.H and small.HV == cfg.HV
    assert {n: tuple(x.shape) for n, x in inputs.tensors.items()} == expected_shapes(small)
    assert inputs.do.shape == (small.B, small.T, small.HV, small.V)
    assert inputs.dht.shape == (small.N, small.HV, small.K, small.V)
    assert set(inputs.grad_names) <= set(inputs.tensors)
    for name, x in inputs.tensors.items():
        if x.is_floating_point():
            assert torch.isfinite(x).all() and x.abs().sum() > 0, name


def test_inputs_are_deterministic_and_realistic():
    cfg = get_config("gdn/h4-hv16/varlen9x16384")
    a, b = make_inputs(cfg, "cpu", tiny=True), make_inputs(cfg, "cpu", tiny=True)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    assert not torch.equal(a.tensors["q"], make_inputs(cfg, "cpu", seed=1, tiny=True).tensors["q"])
    assert (a.tensors["g"] < 0).all() and a.tensors["g"].dtype == torch.float32
    assert ((a.tensors["beta"] > 0) & (a.tensors["beta"] < 1)).all()
    assert a.tensors["cu_seqlens_cpu"].tolist()[-1] == a.cfg.T and a.tensors["cu_seqlens_cpu"].device.type == "cpu"
    kda = make_inputs(get_config("kda/h64/1x8192"), "cpu", tiny=True)
    assert kda.tensors["beta"].min() < 0  # raw logits: the op applies the sigmoid
    assert kda.tensors["dt_bias"].dtype == torch.float32 and kda.tensors["A_log"].dtype == torch.float32
    gla = make_inputs(get_config("gla/h32/1x8192"), "cpu", tiny=True)
    assert torch.allclose(gla.tensors["k"].float().norm(dim=-1), torch.ones(()), atol=1e-2)


def test_scale_down_keeps_varlen_shape_and_decode():
    tiny = scale_down(get_config("gdn/h16-hv64/varlen9x16384"))
    assert len(tiny.lengths) == 9 and min(tiny.lengths) == 1 and 50 <= tiny.T <= 80
    dec = scale_down(get_config("gdn-decode/h16-hv32/n256"))
    assert dec.T == 1 and dec.B == 4


def test_grad_and_float64_copies():
    inputs = make_inputs(get_config("simple_gla/h64/1x8192"), "cpu", tiny=True)
    ginputs, leaves = with_grad(inputs)
    assert all(x.requires_grad for x in leaves) and "g_gamma" not in inputs.grad_names
    assert leaves[0].data_ptr() == inputs.tensors["q"].data_ptr()
    f64 = to_float64(inputs)
    assert f64.tensors["q"].dtype == torch.float64 and f64.do.dtype == torch.float64
    kwargs = call_kwargs(inputs)
    assert kwargs["g_gamma"].shape == (64,) and kwargs["output_final_state"] is True


def test_work_model_matches_the_budgets():
    gdn = get_config("gdn/h16-hv64/1x8192")
    assert flops_per_token_head(gdn, "fwd") == pytest.approx(180e3, rel=0.01)
    assert flops_per_token_head(get_config("gla/h32/1x8192"), "fwd") == pytest.approx(100e3, rel=0.03)
    assert flops_per_token_head(gdn, "fwdbwd") == pytest.approx(180e3 + 500e3, rel=0.03)
    dec = get_config("gdn-decode/h16-hv32/n1")
    inputs = make_inputs(dec, "cpu")
    flops, nbytes = work(inputs, "decode")
    state = 2 * dec.HV * dec.K * dec.V * 4
    assert state < nbytes < state * 1.05 and flops == 7 * 128 * 128 * dec.HV


# ----------------------------------------------------------------------------- report

def _records():
    base = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "fla": "0.6.0", "commit": "abc"}
    return [
        {**base, "op": "chunk_gated_delta_rule", "config": "gdn/h16-hv64/1x8192", "mode": "fwd",
         "fastla_ms_graph": 0.41, "fastla_ms_eager": 0.62, "fla_ms_graph": 0.86, "fla_ms_eager": 1.27,
         "ratio": 2.0975, "tflops": 230.1, "gbps": 1500.0, "fastla_rel_err": 3e-3, "fla_rel_err": 4e-3,
         "cold_s": 12.3},
        {**base, "op": "chunk_gated_delta_rule", "config": "gdn/h16-hv32/1x8192", "mode": "fwdbwd",
         "fastla_ms_eager": 2.0, "fla_ms_eager": 3.72, "ratio": None, "ratio_note": "fastla rel err 1e-1 > 2e-2",
         "fastla_rel_err": "nan", "fla_rel_err": 4e-3, "fla_note": runner.FLA_GUARD_NOTE},
        {**base, "op": "fused_recurrent_kda", "config": "kda-decode/h32-hv32/n1", "mode": "decode",
         "error": "boom"},
    ]


def test_render_markdown_table():
    md = report.render_markdown(_records())
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| op"))
    assert header.count("|") == len(report.COLUMNS) + 1
    assert "**2.10x**" in md and "0.410 / 0.620" in md and "refused" in md and "nan / 4.0e-03" in md
    assert "\u2020" in md and runner.FLA_GUARD_NOTE in md and "boom" in md and "NVIDIA H200" in md
    assert report.render_markdown([]).startswith("No benchmark")


def test_readme_block_and_report_cli(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nold\n{report.README_END}\ntail\n")
    report.update_readme_table(readme, "| new |")
    assert readme.read_text() == f"intro\n{report.README_START}\n| new |\n{report.README_END}\ntail\n"
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(ValueError):
        report.update_readme_table(bare, "md")
    result = tmp_path / "nvidia-h200-20260101-000000.json"
    result.write_text(json.dumps({"metadata": {}, "records": _records()}))
    assert report.main([str(result), "--readme", str(readme)]) == 0
    assert (tmp_path / "nvidia-h200-20260101-000000.md").read_text() in capsys.readouterr().out
    assert "gdn/h16-hv64/1x8192" in readme.read_text()


# ----------------------------------------------------------------------------- runner

def test_argument_parsing_and_filtering():
    args = runner.parse_args(["--filter", "gdn/h2,kda/h64", "--modes", "fwd", "--quick", "--no-cold"])
    assert args.quick and args.no_cold and not args.no_fla and not args.no_graph
    assert runner.timing_from_args(args) == runner.QUICK_TIMING
    assert runner.timing_from_args(runner.parse_args(["--budget-s", "5"])).budget_s == 5
    selected = select_configs(CONFIGS, args.filter, parse_modes(args.modes))
    names = [c.name for c, _ in selected]
    assert names and all(n.startswith(("gdn/h2-", "kda/h64/")) for n in names)
    assert all(modes == ("fwd",) for _, modes in selected)
    assert select_configs(CONFIGS, "decode", ("fwd",)) == []
    assert [m for _, m in select_configs(CONFIGS, "gdn-decode", parse_modes(None))] == [("decode",)] * 4
    with pytest.raises(ValueError):
        parse_modes("fwd,bwd")


def test_main_without_cuda_is_clear_and_nonzero(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runner.main(["--filter", "gdn/h2-hv8/1x8192"]) == 2
    assert "CUDA" in capsys.readouterr().err
    assert runner.main(["--filter", "no-such-config"]) == 2
    assert runner.main(["--modes", "nope"]) == 2
    assert runner.main(["--list", "--filter", "lightning"]) == 0
    assert "lightning/h64/1x32768" in capsys.readouterr().out


def test_verdict_times_and_json(tmp_path):
    rec = {"mode": "fwd", "fastla_ms_graph": 0.5, "fastla_ms_eager": 1.0, "fla_ms_graph": None, "fla_ms_eager": 2.0}
    runner.pick_times(rec)
    assert rec["timing"] == "eager" and rec["fastla_ms"] == 1.0 and rec["fla_ms"] == 2.0
    assert runner.speedup_verdict({**rec, "fastla_rel_err": 1e-3}, 2e-2) == (2.0, None)
    assert runner.speedup_verdict({**rec, "fastla_rel_err": math.nan}, 2e-2)[0] is None
    assert runner.speedup_verdict({**rec, "fastla_rel_err": 0.5}, 2e-2)[0] is None
    assert runner.speedup_verdict(rec, 2e-2) == (None, "no correctness check")
    assert runner.speedup_verdict({**rec, "fastla_vs_fla_rel_err": 1e-3}, 2e-2)[0] == 2.0
    untrusted = {**rec, "fastla_vs_fla_rel_err": 1e-3, "fla_note": runner.FLA_GUARD_NOTE}
    assert runner.speedup_verdict(untrusted, 2e-2)[0] is None
    assert runner.worst([None, 1e-3, math.nan]) != runner.worst([None, 1e-3, math.nan])
    assert runner.rel_err(torch.ones(3), torch.ones(3)) == 0.0
    out = runner.ResultFile(tmp_path / "r.json", {"gpu": "x"})
    out.add({"config": "a", "mode": "fwd", "op": "o", "fastla_rel_err": math.nan, "cold_s": None})
    out.add({"config": "b", "mode": "fwd", "op": "o"})
    again = runner.ResultFile.resume(tmp_path / "r.json", {"gpu": "y"})
    assert again.done() == {("a", "fwd"), ("b", "fwd")} and again.records[0]["fastla_rel_err"] == "nan"
    assert runner.cold_targets(again.records, every=False) == [("a", "fwd")]
    assert runner.cold_targets(again.records, every=True) == [("a", "fwd"), ("b", "fwd")]
    assert runner.gpu_slug("NVIDIA H200") == "nvidia-h200"


def _fake_guarded_fla(monkeypatch):
    """A stand-in for FLA: fastla's op, whose backward refuses (like FLA 0.6.0's GDN on
    Hopper) unless ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1`` is set."""
    chunk_o = types.ModuleType("fla.ops.common.chunk_o")
    chunk_o.TRITON_ABOVE_3_7_1 = False
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", chunk_o)
    real_load = runner.load_op

    def load(lib, cfg):
        op = real_load("fastla", cfg)
        if lib == "fastla":
            return op

        def fla_like(**kwargs):
            needs_grad = any(isinstance(x, torch.Tensor) and x.requires_grad for x in kwargs.values())
            if needs_grad and not chunk_o.TRITON_ABOVE_3_7_1:
                raise RuntimeError("... incorrect results for gated chunk_bwd_dqkwg (see #640)")
            return op(**kwargs)

        return fla_like

    monkeypatch.setattr(runner, "load_op", load)
    return chunk_o


def test_one_tiny_config_end_to_end_on_cpu(monkeypatch):
    chunk_o = _fake_guarded_fla(monkeypatch)
    monkeypatch.setattr(runner, "time_eager", lambda fn, timing: (fn(), 1.0)[1])
    monkeypatch.setattr(runner, "time_graph", lambda fn, timing: (fn(), (0.5, None))[1])
    ctx = runner.RunContext(runner.QUICK_TIMING, {"gpu": "cpu", "commit": "abc"}, True, None, True, 2e-2, "cpu")
    cfg = replace(scale_down(get_config("gdn/h2-hv8/1x8192"), tokens=32), K=32, V=32)   # (interpreter time)
    monkeypatch.setattr(runner, "make_inputs", lambda c, device, seed: make_inputs(cfg, device, seed))
    fwd, bwd = runner.bench_config(ctx, cfg, ("fwd", "fwdbwd"), seed=0)
    from fastla.backends.triton import interpreting
    assert fwd["fastla_tier"] == ("triton" if interpreting() else "torch")   # the GDN forward kernel
    assert fwd["timing"] == "graph" and fwd["ratio"] == 1.0
    assert fwd["fastla_rel_err"] < 2e-2 and fwd["fastla_vs_fla_rel_err"] == 0.0 and fwd["fla_note"] is None
    assert fwd["flops"] > 0 and fwd["gbps"] > 0 and not fwd["skipped"]
    assert bwd["fla_note"] == runner.FLA_GUARD_NOTE and bwd["timing"] == "eager"
    assert bwd["fastla_grad_rel_err"] < 5e-2 and bwd["fla_ms_eager"] == 1.0 and bwd["ratio"] == 1.0
    assert chunk_o.TRITON_ABOVE_3_7_1 is False
    assert "fastla" in runner.summary_line(bwd)


def test_later_results_supersede_earlier(tmp_path):
    from fastla.bench.report import load_records
    old = {"records": [{"config": "a", "mode": "fwd", "fastla_ms": 2.0}, {"config": "b", "mode": "fwd"}]}
    new = {"records": [{"config": "a", "mode": "fwd", "fastla_ms": 1.0}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    recs = load_records([tmp_path / "old.json", tmp_path / "new.json"])
    assert [(r["config"], r.get("fastla_ms")) for r in recs] == [("a", 1.0), ("b", None)]


def test_tier_flag_sets_the_backend(monkeypatch):
    import os

    from fastla.bench.runner import main
    monkeypatch.setenv("FASTLA_BACKEND", "torch")           # restored by monkeypatch afterwards
    assert main(["--list", "--filter", "decode", "--tier", "triton"]) == 0
    assert os.environ["FASTLA_BACKEND"] == "triton"


def _compile_times_module():
    pytest.importorskip("triton.experimental.gluon")
    sys.path.insert(0, str(runner.REPO_ROOT / "benchmarks"))
    try:
        import compile_times
    finally:
        sys.path.pop(0)
    return compile_times


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU's cold start is timed by the bench itself")
def test_compile_times_script_compiles_a_calls_kernels_for_sm90(tmp_path):
    """benchmarks/compile_times.py: one config's first call compiles the kernels it launches (the
    GDN prologue's two sm_90 kernels and the scan), each for sm_90 with a positive time, one after
    another (``--ahead off``) and the same kernels side by side (``on``, fastla/core/compile_ahead.py)."""
    compile_times = _compile_times_module()
    out = tmp_path / "compile.json"
    assert compile_times.main(["--filter", "gdn/h2-hv8/1x8192", "--ahead", "off,on", "--json", str(out)]) == 0
    serial, ahead = json.loads(out.read_text())["results"]
    names = [n for n, _ in serial["kernels"]]
    assert {"_gdn_inverse_sm90_kernel", "_gdn_scores_sm90_kernel", "_scan_dual_sm90_kernel"} <= set(names)
    assert all(s > 0 for _, s in serial["kernels"]) and serial["call_s"] >= serial["compile_s"] > 0
    assert not serial["ahead"] and ahead["ahead"] and sorted(n for n, _ in ahead["kernels"]) == sorted(names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU's cold start is timed by the bench itself")
def test_compile_times_script_sets_knobs(tmp_path):
    """``--knob module:ATTR=value`` sets a switch in the child before the call: KDA's first call with
    the Triton inverse kernel (chunk_prepare_kda_sm90.INVERSE_SM90 off) compiles it, with the call's
    own arguments, in place of the Gluon one."""
    compile_times = _compile_times_module()
    out = tmp_path / "compile.json"
    knob = "fastla.backends.gluon.chunk_prepare_kda_sm90:INVERSE_SM90=False"
    assert compile_times.main(["--filter", "kda/h64/1x8192", "--ahead", "off", "--knob", knob, "--json", str(out)]) == 0
    (res,) = json.loads(out.read_text())["results"]
    names = {n for n, _ in res["kernels"]}
    assert "_kda_inverse_kernel" in names and "_kda_inverse_sm90_kernel" not in names, names
