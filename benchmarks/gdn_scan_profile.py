"""Cycle profile of one chunk step of the Gluon GDN scan (backends/gluon/chunk_delta_sm90.py) on
the GPU: where a step's time goes, phase by phase.

It builds an instrumented copy of the kernel (in a temporary folder; the shipped kernel is not
touched): ``%clock`` is read at the phase boundaries listed in ``PHASES`` (each names a line of
the kernel's step, the read going before or after it) and the differences are summed per phase
in registers, then stored by each program's first thread. The copy runs in place of the kernel
through the Gluon tier's own launcher. Cycles are per step, averaged over programs; the reads
cost a few cycles each and the accumulators a few registers, so phases near a register limit
are perturbed somewhat. A marker that no longer matches the kernel stops the script: update
``PHASES`` with the kernel.

    python benchmarks/gdn_scan_profile.py [--shapes NAME[:BV],..]        (K = 128 shapes: the markers
                                                                        are in the two-half branch)

Measured numbers and their reading: docs/notes/gdn-prefill.md (v9).
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile

import torch

KERNEL = pathlib.Path(__file__).resolve().parents[1] / "fastla" / "backends" / "gluon" / "chunk_delta_sm90.py"

# (line of the kernel's step, phase that ends at it, read the clock before the line?)
PHASES = [
    ("        b_G, b_Gl, b_rk, b_rq = n_G, n_Gl, n_rk, n_rq\n", None, True),
    ("        mbarrier.wait(bars.index(stage), ((i // STAGES) & 1).to(gl.int32))\n", "top of the step, TMA wait", False),
    ("        x = warpgroup_mma_wait(num_outstanding=NK, deps=(x,))\n", "X = k S (Q = q S issued)", False),
    ("        vn = warpgroup_mma(p_s.index(stage), y_s, zero, use_acc=False, is_async=True)\n", "Y elementwise, to smem", True),
    ("        vn, qs = warpgroup_mma_wait(num_outstanding=0, deps=(vn, qs))\n", "V_new = P Y wait", False),
    ("        b_egl = gl.exp(b_Gl)\n", "V_new, D to smem", True),
    ("            S0, S1 = warpgroup_mma_wait(num_outstanding=1, deps=(S0, S1))\n", "state update (output issued)", False),
    ("        out = warpgroup_mma_wait(num_outstanding=0, deps=(out,))\n", "state to smem, output wait", False),
    ("        _store_output(out, o_desc, o_s, o, t0, eos, r, o_v, i_hv32, i_v, n_rows, HV, V, BV)\n", "output epilogue", False),
    ("i + STAGES < n_chunks, K, V, BV, NK)\n", "barrier, next TMA issue", False),
]
CLOCK = '''
@gluon.jit
def _clock(x):
    return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

'''
SLOTS = 16          # int32 per program: phases 1.., steps in the last slot


def _instrument(src: str) -> str:
    def once(old: str, new: str) -> str:
        if src.count(old) != 1:
            raise SystemExit(f"marker not found once in the kernel (update PHASES): {old.strip()!r}")
        return src.replace(old, new)

    n = len(PHASES) - 1
    src = once("BT = gl.constexpr(64)", CLOCK + "BT = gl.constexpr(64)")
    src = once("STAGES: gl.constexpr, WARPGROUPS: gl.constexpr,\n):", "STAGES: gl.constexpr, WARPGROUPS: gl.constexpr, prof=None,\n):")
    for j, (line, _, before) in enumerate(PHASES):
        indent = line[:len(line) - len(line.lstrip())] or " " * 8
        read = f"{indent}clk{j} = _clock(r)\n"
        src = once(line, read + line if before else line + read)
    last = f"        clk{n} = _clock(r)\n"
    src = once(last, last + "".join(f"        ph{j} += clk{j} - clk{j - 1}\n" for j in range(1, n + 1)))
    init = "    zero = gl.zeros([BT, BV], gl.float32, acc)\n"
    src = once(init, init + "".join(f"    ph{j} = gl.zeros([BT], gl.int32, rows)\n" for j in range(1, n + 1)))
    end = "    tma.store_wait(0)\n    for st in gl.static_range(STAGES):\n"
    store = (f"    pb = prof + (gl.program_id(0).to(gl.int64) * gl.num_programs(1) + i_v) * {SLOTS}\n"
             + "".join(f"    gl.store(pb + {j} + r * 0, ph{j}, mask=r == 0)\n" for j in range(1, n + 1))
             + f"    gl.store(pb + {SLOTS - 1} + r * 0, r * 0 + n_chunks.to(gl.int32), mask=r == 0)\n")
    return once(end, store + end)


def _load(src: str, folder: str):
    path = pathlib.Path(folder) / "gdn_scan_profiled.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("gdn_scan_profiled", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def profile(module, kw: dict, block_v: int | None) -> tuple[tuple[int, int], float, list[float]]:
    """(grid, chunks per program, cycles per step of each phase) of one call."""
    from fastla.backends.gluon import chunk_delta, chunk_delta_sm90
    from fastla.core.dispatch import use_tier
    from fastla.ops.gated_delta_rule import chunk_gated_delta_rule

    buf = torch.zeros(SLOTS, dtype=torch.int32, device="cuda")
    seen = {}

    class Instrumented:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                buf.resize_(grid[0] * grid[1] * SLOTS).zero_()
                module._scan_sm90_kernel[grid](*args, prof=buf, **kwargs)
                seen["grid"] = grid
            return launch

    saved, saved_bv = chunk_delta_sm90._scan_sm90_kernel, chunk_delta.SCAN_BLOCK_V
    chunk_delta_sm90._scan_sm90_kernel, chunk_delta.SCAN_BLOCK_V = Instrumented(), block_v
    try:
        with use_tier("gluon", strict=True), torch.no_grad():
            for _ in range(2):                                              # the second call is measured
                chunk_gated_delta_rule(**kw)
            torch.cuda.synchronize()
    finally:
        chunk_delta_sm90._scan_sm90_kernel, chunk_delta.SCAN_BLOCK_V = saved, saved_bv
    per = buf.view(-1, SLOTS).double().cpu()
    steps = per[:, SLOTS - 1].clamp(min=1)
    cycles = (per[:, 1:len(PHASES)] / steps[:, None]).mean(0).tolist()
    return seen["grid"], steps.mean().item(), cycles


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gdn/h16-hv64/1x32768:64,gdn/h16-hv64/1x32768:32,gdn/h4-hv16/1x8192")
    args = ap.parse_args()
    from fastla.bench.inputs import call_kwargs, make_inputs
    from fastla.bench.registry import get_config

    with tempfile.TemporaryDirectory() as folder:
        module = _load(_instrument(KERNEL.read_text()), folder)
        for item in args.shapes.split(","):
            name, _, bv = item.partition(":")
            kw = call_kwargs(make_inputs(get_config(name), "cuda"))
            grid, steps, cycles = profile(module, kw, int(bv) if bv else None)
            print(f"{item}: grid {grid}, {steps:.0f} chunks per program, {sum(cycles):.0f} cycles per step")
            for (_, phase, _), c in zip(PHASES[1:], cycles):
                print(f"    {phase:32s} {c:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
