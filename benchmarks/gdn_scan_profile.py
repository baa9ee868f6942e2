"""Cycle profile of one chunk step of the Gluon GDN scan on the GPU: where a step's time goes,
phase by phase, in the shipped two-chain scan's chain partitions (``--kernel dual``,
chunk_delta_dual_sm90.py; both chains, averaged), the one-chain scan (``plain``,
chunk_delta_sm90.py) or the warp-specialized one's chain partition (``ws``).

It builds an instrumented copy of the kernel (in a temporary folder; the shipped kernel is not
touched): ``%clock`` is read at the phase boundaries listed in ``PHASES`` (each names a line of
the kernel's step, the read going before or after it) and the differences are summed per phase
in registers, then stored by each program's first thread. The copy runs in place of the kernel
through the Gluon tier's own launcher. Cycles are per step, averaged over programs; the reads
cost a few cycles each and the accumulators a few registers, so phases near a register limit
are perturbed somewhat. A marker that no longer matches the kernel stops the script: update
``PHASES`` with the kernel.

    python benchmarks/gdn_scan_profile.py [--kernel dual|plain|ws] [--shapes NAME[:BV],..]
                                        (K = 128 shapes: the markers are in the two-half branch)

Measured numbers and their reading: docs/notes/gdn-prefill.md (v9).
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile

import torch

from fastla.core import call_plan

call_plan.ENABLED = False       # the sweeps change plan choices (tiles, prologues) between calls

GLUON = pathlib.Path(__file__).resolve().parents[1] / "fastla" / "backends" / "gluon"

# (line of the kernel's step, phase that ends at it, read the clock before the line?; a line
# may be named twice, before and after). The products are one phase since they moved into
# chunk_delta_sm90._chunk_step (shared with the two-chain scan); v9's per-product phases
# (docs/notes/gdn-prefill.md) were read before that
# the step's first line in the one- and two-chain kernels (chunk_delta_sm90._chunk_rows)
ROWS_LINE = "        t0, m_t, b_G, b_Gl, b_beta, b_rk, b_rq, b_dec0, b_dec1, n_G, n_Gl, n_beta, n_rk, n_rq = _chunk_rows(\n"
PHASES = [
    (ROWS_LINE, None, True),
    ("        mbarrier.wait(bars.index(stage), ((i // STAGES) & 1).to(gl.int32))\n", "top of the step, TMA wait", False),
    ("        _store_output(out, o_desc, o_s, o, t0, eos, r, o_v, i_hv32, i_v, n_rows, HV, V, BV)\n", "the chunk's products",
     True),
    ("        _store_output(out, o_desc, o_s, o, t0, eos, r, o_v, i_hv32, i_v, n_rows, HV, V, BV)\n", "output epilogue", False),
    ("i + STAGES < n_chunks, K, V, BV, NK, GK, DELTA)\n", "barrier, next TMA issue", False),
]
# the warp-specialized scan's chain partition (the prep partition runs beside it)
WS_PHASES = [
    ("        b_G, b_Gl, b_rk, b_rq = n_G, n_Gl, n_rk, n_rq\n", None, True),
    ("        mbarrier.wait(c_loaded.index(cs), ((i // 2) & 1).to(gl.int32))\n", "top, q / A_qk tiles wait", False),
    ("        mbarrier.wait(wu_ready, (i & 1).to(gl.int32))\n", "W, U wait (the prep)", False),
    ("        vn = warpgroup_mma_wait(num_outstanding=NK, deps=(vn,))\n", "V_new = U - W S (Q issued)", False),
    ("        b_egl = gl.exp(b_Gl)\n", "V_new, D to smem", True),
    ("        S0 = warpgroup_mma(k_s.index(ks * NK).permute((1, 0)), vd_s, S0 * b_egl, is_async=True)\n",
     "Q wait, keys wait", True),
    ("            S0, S1 = warpgroup_mma_wait(num_outstanding=1, deps=(S0, S1))\n", "state update (output issued)", False),
    ("        out = warpgroup_mma_wait(num_outstanding=0, deps=(out,))\n", "state to smem, output wait", False),
    ("        _store_output(out, o_desc, o_s, o, t0, eos, r, o_v, i_hv, i_v, n_rows, HV, V, BV)\n", "output epilogue", False),
]
# the two-chain scan's chain partitions (both instrumented; cycles averaged over chains too)
DUAL_PHASES = [
    (ROWS_LINE, None, True),
    ("        mbarrier.wait(loaded.index(stage), ((i // STAGES) & 1).to(gl.int32))\n", "top of the step, TMA wait", False),
    ("        mbarrier.arrive(freed.index(stage), count=1)                        # this chain is done with the stage\n",
     "the chunk's products", True),
    ("        mbarrier.arrive(freed.index(stage), count=1)                        # this chain is done with the stage\n",
     "stage release", False),
    ("            _store_output(out, o_desc, o_s.index(CH), o, t0, eos, r, o_v, i_hv, tile_v, n_rows, HV, V, BVC)\n",
     "output epilogue", False),
]
# per kernel: file, kernel name, phases, where the clock helper goes, how ``prof`` reaches the
# instrumented function (text replacements: old, new and how often old occurs), the line after
# which the phase counters start, the line before which they are stored, and the programs'
# partitions that each store a row of counters (``chains``)
TARGETS = {
    "plain": dict(
        file="chunk_delta_sm90.py", kernel="_scan_sm90_kernel", phases=PHASES, clock_before="BT = gl.constexpr(64)",
        prof=[("STAGES: gl.constexpr, WARPGROUPS: gl.constexpr, GK: gl.constexpr,\n    DELTA: gl.constexpr,\n):",
               "STAGES: gl.constexpr, WARPGROUPS: gl.constexpr, GK: gl.constexpr,\n    DELTA: gl.constexpr, prof=None,\n):")],
        init="    zero = gl.zeros([BT, BV], gl.float32, acc)\n",
        end="    tma.store_wait(0)\n    for st in gl.static_range(STAGES):\n"),
    "ws": dict(
        file="chunk_delta_ws_sm90.py", kernel="_scan_ws_sm90_kernel", phases=WS_PHASES, clock_before="PREP_REGS = ",
        prof=[("STORE_STATES: gl.constexpr, PREP_NREG: gl.constexpr,\n):",
               "STORE_STATES: gl.constexpr, PREP_NREG: gl.constexpr, prof=None,\n):"),
              ("L2NORM: gl.constexpr, SEG: gl.constexpr, STORE_STATES: gl.constexpr):",
               "L2NORM: gl.constexpr, SEG: gl.constexpr, STORE_STATES: gl.constexpr, prof):"),
              ("HAS_H0, STORE_FINAL, L2NORM, SEG, STORE_STATES)),", "HAS_H0, STORE_FINAL, L2NORM, SEG, STORE_STATES, prof)),")],
        init="    zero = gl.zeros([BT, BV], gl.float32, acc)\n",
        end="    tma.store_wait(0)\n    if STORE_FINAL:\n"),
    "dual": dict(
        file="chunk_delta_dual_sm90.py", kernel="_scan_dual_sm90_kernel", phases=DUAL_PHASES,
        clock_before="CHAIN_REGS = ",
        prof=[("LOADER_NREG: gl.constexpr, DELTA: gl.constexpr,\n):", "LOADER_NREG: gl.constexpr, DELTA: gl.constexpr, prof=None,\n):"),
              ("STAGES: gl.constexpr, GK: gl.constexpr, DELTA: gl.constexpr):\n    \"\"\"Chain CH",
               "STAGES: gl.constexpr, GK: gl.constexpr, DELTA: gl.constexpr, prof):\n    \"\"\"Chain CH"),
              ("HAS_H0, STORE_FINAL, L2NORM, BETA, SEG, STORE_STATES, STAGES, GK, DELTA)),",
               "HAS_H0, STORE_FINAL, L2NORM, BETA, SEG, STORE_STATES, STAGES, GK, DELTA, prof)),", 2)],
        init="    zero = gl.zeros([BT, BVC], gl.float32, acc)\n",
        end="    tma.store_wait(0)\n    if SEG == 1:",
        chains=2),
}
CLOCK = '''
@gluon.jit
def _clock(x):
    return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

'''
SLOTS = 16          # int32 per program: phases 1.., steps in the last slot


def _instrument(src: str, target: dict) -> str:
    def once(old: str, new: str, count: int = 1) -> str:
        if src.count(old) != count:
            raise SystemExit(f"marker not found {count} time(s) in the kernel (update the phases): {old.strip()!r}")
        return src.replace(old, new)

    phases = target["phases"]
    n = len(phases) - 1
    src = once(target["clock_before"], CLOCK + target["clock_before"])
    for old, new, *count in target["prof"]:
        src = once(old, new, *count)
    for j, (line, _, before) in enumerate(phases):
        indent = line[:len(line) - len(line.lstrip())] or " " * 8
        read = f"{indent}clk{j} = _clock(r)\n"
        src = once(line, read + line if before else line + read)
    last = f"        clk{n} = _clock(r)\n"
    src = once(last, last + "".join(f"        ph{j} += clk{j} - clk{j - 1}\n" for j in range(1, n + 1)))
    init = target["init"]
    src = once(init, init + "".join(f"    ph{j} = gl.zeros([BT], gl.int32, rows)\n" for j in range(1, n + 1)))
    end = target["end"]
    row = "gl.program_id(0).to(gl.int64)"                               # the scans' 1-D grid
    if target.get("chains", 1) > 1:
        row = f"({row} * {target['chains']} + CH)"
    store = (f"    pb = prof + {row} * {SLOTS}\n"
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


def profile(module, target: dict, kw: dict, block_v: int | None) -> tuple[tuple[int], float, list[float]]:
    """(grid, chunks per program, cycles per step of each phase) of one call."""
    from fastla.backends.gluon import chunk_delta, chunk_delta_dual_sm90, chunk_delta_sm90, chunk_delta_ws_sm90
    from fastla.core.dispatch import use_tier
    from fastla.ops.gated_delta_rule import chunk_gated_delta_rule

    buf = torch.zeros(SLOTS, dtype=torch.int32, device="cuda")
    seen = {}
    name = target["kernel"]
    shipped = {"_scan_ws_sm90_kernel": chunk_delta_ws_sm90, "_scan_dual_sm90_kernel": chunk_delta_dual_sm90}.get(
        name, chunk_delta_sm90)
    chains = target.get("chains", 1)

    class Instrumented:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                buf.resize_(grid[0] * chains * SLOTS).zero_()
                getattr(module, name)[grid](*args, prof=buf, **kwargs)
                seen["grid"] = grid
            return launch

    knobs = ("SCAN_BLOCK_V", "SCAN_SPECIALIZED", "SCAN_DUAL")
    saved = getattr(shipped, name), {k: getattr(chunk_delta, k) for k in knobs}
    setattr(shipped, name, Instrumented())
    chunk_delta.SCAN_BLOCK_V = block_v
    chunk_delta.SCAN_SPECIALIZED = shipped is chunk_delta_ws_sm90
    chunk_delta.SCAN_DUAL = shipped is chunk_delta_dual_sm90
    try:
        with use_tier("gluon", strict=True), torch.no_grad():
            for _ in range(2):                                              # the second call is measured
                chunk_gated_delta_rule(**kw)
            torch.cuda.synchronize()
    finally:
        setattr(shipped, name, saved[0])
        for k, value in saved[1].items():
            setattr(chunk_delta, k, value)
    if "grid" not in seen:
        raise SystemExit(f"the {name} scan did not run for this shape (the tile plan chose another kernel)")
    per = buf.view(-1, SLOTS).double().cpu()
    steps = per[:, SLOTS - 1].clamp(min=1)
    cycles = (per[:, 1:len(target["phases"])] / steps[:, None]).mean(0).tolist()
    return seen["grid"], steps.mean().item(), cycles


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=list(TARGETS), default="dual")
    ap.add_argument("--shapes", default="gdn/h16-hv64/1x32768:64,gdn/h16-hv64/1x32768:32,gdn/h4-hv16/1x8192")
    args = ap.parse_args()
    from fastla.bench.inputs import call_kwargs, make_inputs
    from fastla.bench.registry import get_config

    target = TARGETS[args.kernel]
    with tempfile.TemporaryDirectory() as folder:
        module = _load(_instrument((GLUON / target["file"]).read_text(), target), folder)
        for item in args.shapes.split(","):
            name, _, bv = item.partition(":")
            kw = call_kwargs(make_inputs(get_config(name), "cuda"))
            grid, steps, cycles = profile(module, target, kw, int(bv) if bv else None)
            print(f"{args.kernel} {item}: grid {grid}, {steps:.0f} chunks per program, {sum(cycles):.0f} cycles per step")
            for (_, phase, _), c in zip(target["phases"][1:], cycles):
                print(f"    {phase:32s} {c:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
