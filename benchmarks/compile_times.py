"""Cold-start compile cost of the GPU tiers, measured on a machine without a GPU.

Issues 3 and 4 ask for a first call under 10 s per shape class. On the GPU, `python -m fastla
bench --cold-all` times the first call of a config in a fresh process with an empty Triton cache
(``runner.cold_child``). Most of that time is compiling the kernels the call launches for sm_90,
and the compile runs on the host. So this script estimates it without a device.

How. Each config runs in a child process with an empty ``TRITON_CACHE_DIR``. The child runs the
GPU tiers' host code on CPU tensors (``fastla.bench.host_stub``) and compiles, for sm_90, each
kernel specialization that the call launches, with the call's own arguments, timing each compile.

It reports, per config:
- ``compile_s``: the compiles, summed;
- ``call_s``: the whole first call (host code plus compiles);
- ``import_s``: ``import fastla.ops``.

``--ahead on`` (the default here; fastla with ``FASTLA_COMPILE_AHEAD=1``) compiles a first call's
kernels side by side on threads (``fastla/core/compile_ahead.py``); ``--ahead off`` one after
another, at each launch;
``--ahead off,on`` both, each in its own child with its own empty cache. With ``on``, ``compile_s``
sums the compiles' own times on their threads, so it exceeds what the call waited.

A GPU's first call adds what the host cannot show: loading the modules and launching the kernels.
It also runs the host code on the GPU machine's CPUs, whose speed differs from this machine's.

    python benchmarks/compile_times.py                         # one config per shape class
    python benchmarks/compile_times.py --filter kda/h64/1x8192 --json out.json
    python benchmarks/compile_times.py --ahead off,on                # the first call, serial and ahead
    python benchmarks/compile_times.py --filter kda/h64/1x8192 \
        --knob fastla.backends.gluon.chunk_prepare_kda_sm90:INVERSE_SM90=False  # a module switch set first
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# one config per shape class of the GPU tiers' chunked paths: GDN whole sequences, GDN split into
# segments, GDN varlen, KDA with the bounded gate and with the unbounded gate (its wide-block rewrite)
DEFAULT = ("gdn/h16-hv64/1x8192", "gdn/h2-hv8/1x32768", "gdn/h2-hv8/varlen9x16384", "kda/h64/1x8192",
           "kda/h64/1x8192/unbounded")


def _child(name: str, ahead: bool, knobs: list[str]) -> dict:
    start = time.perf_counter()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction, create_function_from_signature

    import fastla.ops  # noqa: F401
    from fastla.core import compile_ahead
    from fastla.bench import host_stub
    from fastla.bench.inputs import call_kwargs, make_inputs
    from fastla.bench.registry import get_config
    from fastla.bench.runner import load_op
    imported = time.perf_counter() - start

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    compiles = []
    compiled_keys = set()

    def compile_then_stub(self, *args, grid, warmup, **kwargs):
        """``host_stub``'s first-launch stand-in, after compiling the launch for sm_90 as
        ``JITFunction.run`` would on the GPU."""
        options = dict(kwargs, debug=False)
        bound, specialization, parsed = create_function_from_signature(self.signature, self.params,
                                                                      backend)(*args, **options)
        parsed, signature, constexprs, attrs = self._pack_args(backend, options, bound, specialization, parsed)
        source = (GluonASTSource if isinstance(self, GluonJITFunction) else ASTSource)(
            self, signature, constexprs, attrs)

        key = (source.hash(), repr(parsed))

        def timed_compile():
            begin = time.perf_counter()
            compiled = triton_compile(source, target=target, options=parsed.__dict__)
            compiles.append((self.fn.__name__, time.perf_counter() - begin))
            compiled_keys.add(key)
            return compiled

        mode = _async_compile.active_mode.get()
        if warmup and mode is not None:         # a dry pass's launch: submitted, as JITFunction.run does
            return mode.submit(key, timed_compile, lambda compiled: None)
        if key not in compiled_keys:            # (a dry pass compiled it: not again)
            timed_compile()
        return stub(self, *args, grid=grid, warmup=warmup, **kwargs)

    host_stub.install()
    compile_ahead.ENABLED = ahead
    for knob in knobs:                                  # module:ATTR=value (a Python literal)
        target_name, value = knob.split("=", 1)
        module, attr = target_name.split(":")
        setattr(importlib.import_module(module), attr, ast.literal_eval(value))
    stub = JITFunction.run
    JITFunction.run = compile_then_stub
    cfg = _config(name, get_config)
    kwargs = call_kwargs(make_inputs(cfg, "cpu"))
    op = load_op("fastla", cfg)
    begin = time.perf_counter()
    op(**kwargs)
    call = time.perf_counter() - begin
    return dict(config=name, ahead=ahead, import_s=imported, call_s=call, compile_s=sum(s for _, s in compiles),
                kernels=[[n, round(s, 3)] for n, s in compiles])


def _config(name: str, get_config):
    """A registry config; ``<name>/unbounded``: a KDA config with the gate in the op and no
    lower bound (the softplus gate, whose wide blocks take the rewrite kernel)."""
    from dataclasses import replace

    if not name.endswith("/unbounded"):
        return get_config(name)
    cfg = get_config(name.rsplit("/", 1)[0])
    options = {k: v for k, v in cfg.options.items() if k not in ("safe_gate", "lower_bound")}
    return replace(cfg, options=options)


def _run(name: str, ahead: bool, timeout: float, knobs: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="fastla-compile-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(TRITON_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
        out = subprocess.run([sys.executable, __file__, "--child", name, "--ahead", "on" if ahead else "off",
                              *(f"--knob={k}" for k in knobs)], capture_output=True, text=True,
                             timeout=timeout, env=env)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(config=name, ahead=ahead, error=f"exit {out.returncode}: {tail[:300]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--filter", default=",".join(DEFAULT), help="comma-separated config names")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per config")
    ap.add_argument("--ahead", default="on", help="off, on or off,on: the first call's compiles one after "
                    "another, or side by side (fastla/core/compile_ahead.py)")
    ap.add_argument("--knob", action="append", default=[], help="module:ATTR=value, set in each child before "
                    "the call (a kernel switch, say); repeatable")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    modes = args.ahead.split(",")
    if not modes or not set(modes) <= {"on", "off"}:
        ap.error(f"--ahead takes off, on or off,on, not {args.ahead!r}")
    if args.child:
        print(json.dumps(_child(args.child, modes[0] == "on", args.knob)))
        return 0
    results = []
    print(f"{'config':32} {'ahead':>5} {'import s':>8} {'call s':>7} {'compile s':>9}  kernels (compile s)", flush=True)
    for name in args.filter.split(","):
        for mode in modes:
            res = _run(name, mode == "on", args.timeout, args.knob)
            results.append(res)
            if "error" in res:
                print(f"{name:32} {mode:>5} {res['error']}", flush=True)
                continue
            kernels = ", ".join(f"{n} {s:.1f}" for n, s in res["kernels"])
            print(f"{name:32} {mode:>5} {res['import_s']:8.1f} {res['call_s']:7.1f} {res['compile_s']:9.1f}  {kernels}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu_count=os.cpu_count(), results=results), indent=1) + "\n")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
