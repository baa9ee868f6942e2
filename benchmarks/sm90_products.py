"""Every Triton kernel a training call launches, compiled for sm_90 on this (GPU-less) machine and
its SASS checked for dropped products: a placeholder HGMMA (no descriptor, no registers) or fewer
HGMMAs than the PTX's wgmmas. ptxas 12.8 and 12.9 both dropped the GLA value kernel's products at
K = V = 64 (docs/notes/chunk-backward.md), which the GPU then ran as zeros.

    python benchmarks/sm90_products.py                    # every chunked op, every head size below (~25 min)
    python benchmarks/sm90_products.py gla,kda            # some ops

The training calls (forward and backward, bf16, dense and varlen) run under fastla.bench.host_stub:
dispatch and launch planning as on a Hopper GPU, each new launch key compiled (marked kernels with
ptxas 12.9, as launch.py builds them) and not run. The Gluon kernels (the forward's sm_90 tier)
are not compiled here: tests/backends/test_gluon_*.py check them. A line per build, ``BAD`` ones
listed again at the end; exit status 1 if any."""
import itertools
import os
import pathlib
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from fastla.bench import host_stub  # noqa: E402
from fastla.backends.triton import chunk_training, launch  # noqa: E402
from tests.backends.test_triton_sm90 import cuobjdump, dropped_products  # noqa: E402
from tests.helpers import LIGHTNING_LAYERS, OPS, make_inputs  # noqa: E402

HEAD_SIZES = [(16, 16), (32, 32), (64, 64), (128, 128), (64, 128), (128, 64), (64, 32), (128, 32), (32, 64),
              (48, 48), (96, 96)]
SHOWN = ("K", "V", "BK", "BV", "DELTA", "GK", "H", "HV")
TARGET = GPUTarget("cuda", 90, 32)


class Checker:
    """``JITFunction.run``'s stand-in: compiles each new (kernel, constexprs, options) for sm_90,
    checks it, then hands the launch to host_stub's."""

    def __init__(self, stub_run):
        self.stub_run = stub_run
        self.backend = make_backend(TARGET)
        self.seen, self.bad, self.case = set(), [], ""

    def __call__(self, fn, *args, grid, warmup, **kwargs):
        if type(fn) is not JITFunction:                 # (a Gluon kernel: the docstring)
            return self.stub_run(fn, *args, grid=grid, warmup=warmup, **kwargs)
        options = dict(kwargs, debug=False)
        bound, specialization, parsed = create_function_from_signature(fn.signature, fn.params, self.backend)(
            *args, **options)
        parsed, signature, constexprs, attrs = fn._pack_args(self.backend, options, bound, specialization, parsed)
        key = (fn.fn.__name__, repr(sorted(constexprs.items(), key=str)), parsed.num_warps, parsed.num_stages)
        if key not in self.seen:
            self.seen.add(key)
            self.check(fn, signature, constexprs, attrs, parsed)
        return self.stub_run(fn, *args, grid=grid, warmup=warmup, **kwargs)

    def check(self, fn, signature, constexprs, attrs, parsed):
        marked = getattr(fn, "fastla_newer_ptxas", False) or getattr(getattr(fn, "base", None), "fastla_newer_ptxas",
                                                                      False)
        source = ASTSource(fn, signature, constexprs, attrs)
        if marked:
            with launch.newer_ptxas_build() as extra:
                kernel = triton.compile(source, target=TARGET, options=dict(parsed.__dict__, **extra))
        else:
            kernel = triton.compile(source, target=TARGET, options=parsed.__dict__)
        with tempfile.TemporaryDirectory() as folder:
            sass = cuobjdump("-sass", kernel.asm["cubin"], folder)
        names = fn.arg_names
        values = {names[k[0]]: v for k, v in constexprs.items() if isinstance(k, tuple)}
        shown = {n: values[n] for n in SHOWN if n in values}
        wrong = dropped_products(kernel.asm["ptx"], sass)
        line = f"{self.case:22s} {fn.fn.__name__:32s} {shown} warps={parsed.num_warps}"
        print(("BAD " + line + " " + wrong) if wrong else ("ok  " + line), flush=True)
        if wrong:
            self.bad.append(line + " " + wrong)


def training_call(op: str, K: int, V: int, varlen: bool) -> None:
    spec = OPS[op]
    t = make_inputs(spec, B=1 if varlen else 2, T=200, H=2, HV=4 if spec.gva else None, K=K, V=V,
                    dtype=torch.bfloat16, N=3 if varlen else None)
    opts = dict(LIGHTNING_LAYERS) if op == "lightning" else {}
    if varlen:
        cu = torch.tensor([0, 70, 71, 200])
        opts.update(cu_seqlens=cu, cu_seqlens_cpu=cu)
    leaves = {n: x.detach().requires_grad_(True) if x.is_floating_point() else x for n, x in t.items()}
    o, ht = spec.chunk(**leaves, **opts, output_final_state=True)[:2]
    (o.float().sum() + ht.float().sum()).backward()


def main(ops) -> int:
    host_stub.install()
    checker = Checker(JITFunction.run)
    JITFunction.run = lambda fn, *a, **kw: checker(fn, *a, **kw)
    launch._compiles_for_sm90 = lambda fn: False        # (the checker builds marked kernels as launch.py does)
    chunk_training.ENABLED = True
    for op, (K, V), varlen in itertools.product(ops, HEAD_SIZES, (False, True)):
        checker.case = f"{op} K{K} V{V}{' varlen' if varlen else ''}"
        training_call(op, K, V, varlen)
    print(f"{len(checker.seen)} builds, {len(checker.bad)} with dropped products")
    for line in checker.bad:
        print("BAD", line)
    return 1 if checker.bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1].split(",") if len(sys.argv) > 1 else list(OPS)))
