"""Kernel launches without Triton's per-call argument binding (host time per call).

Triton 3.6's ``JITFunction.run`` binds and specializes every argument on every launch, builds a
cache key from strings of the specialization and the options, then launches: 30-45 us a launch
of the GDN kernels on the H200 machine's host (docs/notes/gdn-prefill.md). ``Launcher`` wraps a
``@triton.jit`` or ``@gluon.jit`` kernel with a cache of its compiled binaries keyed by what
Triton specializes on, computed cheaply:

* tensors (anything with a data pointer): dtype and whether the pointer is 16-byte aligned (``"D"``);
* ints (not bools): equal to 1 (a constexpr), divisible by 16, and the i32 / i64 / u64 range; only
  the range for ints in ``do_not_specialize``;
* constexprs, positional or keyword, and launch options: by value;
* floats, bools, None and anything else: their type (a TMA descriptor: dtype, box and layout).

A key not seen yet launches through Triton (compiling as needed) and keeps the compiled kernel
it returns; later launches with the key call that kernel's launcher directly (each launch is
reported to a call plan's recording, fastla/core/call_plan.py). Under the
interpreter, with Triton's launch hooks set (profilers), its debug or instrumentation knobs on, a
callable grid, or a runtime argument passed by keyword, every launch goes through Triton. In a dry
pass (fastla/core/compile_ahead.py: a first call's kernels compiled side by side) a launch whose key
is not cached submits its compile and launches nothing.
``tests/backends/test_launch.py`` checks the key against Triton's own specialization.

A build that needs more shared memory than the GPU has (Triton refuses it at its first launch),
launched with an explicit ``num_stages`` (the Triton kernels; a Gluon kernel's buffers are its own),
is rebuilt with one pipeline stage fewer, down to one, before anything launches: fp32 inputs at
K = V = 128 double the Triton scan's tiles (its three-stage build then needs 296 KB, KDA's
two-stage one 311 KB, against Hopper's 227 KB), and GPUs before Hopper have less (164 KB on the
A100). Stages change the schedule of the loads, not the result; each rebuild is logged
(logger ``fastla``, INFO) and kept under the original key.

A kernel marked with ``newer_ptxas`` is assembled for sm_90 by a ptxas of CUDA 12.9 or newer
(``sm90_ptxas``: Triton 3.6 assembles sm_90 with CUDA 12.8.93's and ships 12.9's for Blackwell,
which targets sm_90a as well): 12.8 forms some wgmma shared-memory descriptors of the backward's
reverse scan from the wrong register (docs/notes/chunk-backward.md, twenty-sixth session). Its
builds carry ``PTXAS_MARK`` in their options, so Triton's caches (whose key names one ptxas
version an architecture) keep them apart from a 12.8 build of the same kernel; a dry pass leaves
them to the first real launch (the override is process-wide while it compiles).
"""
from __future__ import annotations

import contextlib
import logging

import torch
from triton import knobs
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

from fastla.core import compile_ahead
from fastla.core.call_plan import recording

_I32 = (-(2 ** 31), 2 ** 31)
FIXED_PTXAS = (12, 9)   # the first ptxas measured to build the reverse scan's descriptors right
PTXAS_MARK = "-O3"      # ptxas's default level: a cache key for the marked builds, not a change
_Tensor = torch.Tensor
CACHED = True       # False: every launch through Triton (benchmarks/gdn_host_overhead.py compares)
_LAUNCHERS: dict[tuple[int, bool], "Launcher"] = {}
logger = logging.getLogger("fastla")


def launcher(fn, T: int | None = None, NT: int | None = None) -> "Launcher":
    """The (one) Launcher of kernel ``fn``. With ``T`` and ``NT`` (a chunked kernel whose
    ``do_not_specialize`` keeps them runtime values): when T is a multiple of 16 and there is
    more than one chunk, the Launcher of ``fn``'s twin that lets Triton specialize them (see
    ``length_specialized``)."""
    twin = T is not None and T % 16 == 0 and NT > 1
    found = _LAUNCHERS.get((id(fn), twin))
    if found is None or found.base is not fn:
        found = _LAUNCHERS[(id(fn), twin)] = Launcher(length_specialized(fn) if twin else fn)
        found.base = fn
    return found


def newer_ptxas(fn):
    """Marks kernel ``fn`` to be assembled for sm_90 by ``sm90_ptxas()`` (the module's docstring)."""
    fn.fastla_newer_ptxas = True
    return fn


def _version(tool) -> tuple:
    try:
        return tuple(int(x) for x in tool.version.split(".")[:2])
    except (AttributeError, ValueError):
        return ()


def sm90_ptxas():
    """The ptxas (Triton's ``NvidiaTool``) that assembles marked kernels for sm_90: Triton's sm_90
    one when it is 12.9 or newer, else its Blackwell one when that is; None when neither is."""
    for name in ("ptxas", "ptxas_blackwell"):
        try:
            tool = getattr(knobs.nvidia, name)
        except RuntimeError:                    # (not installed)
            continue
        if _version(tool) >= FIXED_PTXAS:
            return tool
    return None


@contextlib.contextmanager
def newer_ptxas_build():
    """Within it, Triton assembles with ``sm90_ptxas()``; yields the options a build then takes
    (``PTXAS_MARK``). Raises where there is no such ptxas."""
    tool = sm90_ptxas()
    if tool is None:
        raise RuntimeError(f"needs ptxas {FIXED_PTXAS[0]}.{FIXED_PTXAS[1]} or newer on sm_90 (TRITON_PTXAS_PATH)")
    with knobs.nvidia.scope():
        knobs.nvidia.ptxas = tool.path
        yield {"ptx_options": PTXAS_MARK}


def _compiles_for_sm90(fn) -> bool:
    """Whether Triton compiles ``fn`` (not the interpreter) for an sm_90 device."""
    return isinstance(fn, JITFunction) and torch.cuda.get_device_capability() == (9, 0)


_TWINS: dict[int, object] = {}


def length_specialized(fn):
    """``fn`` compiled without its ``do_not_specialize`` list: lengths divisible by 16 are then
    known so. Measured on the H200 (A/B in one process, 1x8k): the Gluon scan at 32 columns 186 ->
    168 us (HV16) and 229 -> 193 us (HV32), the scores kernel 19 -> 14 us. The chunked kernels keep
    T and NT runtime values by default because the variant Triton compiles for T = 1 (a constant
    single-trip chunk loop) faulted on the H200 (docs/notes/gdn-prefill.md); ``launcher`` takes
    this twin only for T a multiple of 16 with NT > 1, which never compiles T = 1 or NT = 1."""
    if not isinstance(fn, JITFunction):                     # the interpreter's, or a test's stand-in
        return fn
    twin = _TWINS.get(id(fn))
    if twin is None or twin[0] is not fn:
        options = dict(do_not_specialize_on_alignment=fn.do_not_specialize_on_alignment, debug=fn.debug,
                       noinline=fn.noinline, launch_metadata=fn.launch_metadata)
        twin = _TWINS[id(fn)] = (fn, type(fn)(fn.fn, **options))
    return twin[1]


def _int_class(x: int) -> int:
    """Triton's integer type of an argument: 0 i32, 1 i64, 2 u64 (Triton refuses >= 2**64 at the
    first launch, which is never cached)."""
    if _I32[0] <= x < _I32[1]:
        return 0
    return 2 if x >= 2 ** 63 else 1


def _int_key(x: int, mode: int):
    """An int argument's part of the key: equal to 1, divisible by 16 and width when Triton
    specializes on it (``mode`` 1), the width alone otherwise."""
    return (x == 1, x & 15 == 0, _int_class(x)) if mode == 1 else _int_class(x)


class Launcher:
    """``Launcher(kernel)[grid](*args, **constexprs_and_options)``, as the kernel itself."""

    def __init__(self, fn):
        self.fn = fn
        self.base = fn          # the kernel ``launcher`` was asked for (fn may be its twin)
        params = fn.params if isinstance(fn, JITFunction) else ()      # not the interpreter's kernels
        self._names = [p.name for p in params]
        # per positional parameter: 0 a constexpr (keyed by value), 1 a runtime value specialized
        # on (an int's 1 / 16), 2 one that is not (do_not_specialize)
        self._mode = [0 if p.is_constexpr else (2 if p.do_not_specialize else 1) for p in params]
        self._runtime = {p.name for p in params if not p.is_constexpr}   # must come positionally
        self._defaults = {p.name: p.default for p in params if p.has_default}
        self._cache: dict = {}

    @property
    def newer_ptxas(self) -> bool:
        """Whether the kernel is marked by ``newer_ptxas`` (its twin carries no mark)."""
        return getattr(self.base, "fastla_newer_ptxas", False)

    def __getattr__(self, name):        # arg_names, params, ...: the kernel's
        if name == "fn":
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args, kwargs) -> tuple:
        k = []
        for a, mode in zip(args, self._mode):
            c = a.__class__
            if c is _Tensor:
                k += (a.dtype, a.data_ptr() & 15 == 0)
            elif mode == 0:
                k.append(("constexpr", a))
            elif c is int:                                              # (exact: bools and IntEnums below)
                k.append(_int_key(a, mode))
            elif c is float:
                k.append(float)
            elif hasattr(a, "data_ptr"):
                k += (getattr(a, "dtype", None), a.data_ptr() & 15 == 0)
            elif isinstance(a, int) and c is not bool:
                k.append(_int_key(a, mode))
            elif hasattr(a, "block_shape"):                             # a TMA descriptor
                k.append((c, a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None),
                          getattr(a, "padding", None)))
            else:
                k.append(c)
        k.append(tuple(kwargs.items()))
        k.append(torch.cuda.current_device())
        return tuple(k)

    def launch(self, grid, args, kwargs):
        if compile_ahead.dry():     # (its compile submitted under Triton's AsyncCompileMode, nothing launched)
            if (not self._names or self.key(args, kwargs) not in self._cache) and not self.newer_ptxas:
                self.fn.run(*args, grid=grid, warmup=True, **kwargs)
            return None
        rec = recording()
        if (not CACHED or not self._names or callable(grid) or hooks_active()
                or not self._runtime.isdisjoint(kwargs)):
            if rec is not None:
                rec.unplanned("a launch went through Triton's own launcher")
            return self.through_triton(grid, args, kwargs)
        key = self.key(args, kwargs)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self.through_triton(grid, args, kwargs)
            self._cache[key] = compiled
            if rec is not None:
                rec.launches.append((compiled, grid, self.arguments(args, kwargs), current_stream(key[-1])))
            return compiled
        values = self.arguments(args, kwargs)
        stream = current_stream(key[-1])
        run_compiled(compiled, (tuple(grid) + (1, 1))[:3], stream, values)
        if rec is not None:
            rec.launches.append((compiled, grid, values, stream))
        return compiled

    def through_triton(self, grid, args, kwargs):
        """Launch through Triton (compiling as needed); a build over the GPU's shared memory is
        rebuilt with one stage fewer, down to one; a marked kernel on sm_90 assembled by
        ``sm90_ptxas()`` (the module's docstring)."""
        if self.newer_ptxas and _compiles_for_sm90(self.fn):
            with newer_ptxas_build() as options:
                return self._through_triton(grid, args, {**kwargs, **options})
        return self._through_triton(grid, args, kwargs)

    def _through_triton(self, grid, args, kwargs):
        while True:
            try:
                return self.fn[grid](*args, **kwargs)
            except OutOfResources as exc:
                stages = kwargs.get("num_stages")
                if exc.name != "shared memory" or stages is None or stages <= 1:
                    raise
                logger.info("fastla: %s at %d stages needs %d bytes of shared memory (the GPU has %d): "
                            "rebuilding at %d", getattr(self.fn, "__name__", self.fn), stages, exc.required,
                            exc.limit, stages - 1)
                kwargs = dict(kwargs, num_stages=stages - 1)

    def arguments(self, args, kwargs) -> list:
        """Every parameter's value in order, as Triton passes them to a compiled kernel's launcher:
        the positional ones, then keywords (constexprs) or defaults."""
        values = list(args)
        for name in self._names[len(args):]:
            values.append(kwargs[name] if name in kwargs else self._defaults[name])
        return values


def hooks_active() -> bool:
    """Whether Triton's launch hooks (3.6 keeps always-present chains of them, empty by default),
    its debug mode or its instrumentation are on: then every launch goes through Triton."""
    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and bool(getattr(hook, "calls", True)):
            return True
    return bool(rt.debug) or knobs.compilation.instrumentation_mode not in ("", None)


def run_compiled(compiled, grid: tuple[int, int, int], stream: int, values) -> None:
    """Launch a compiled kernel with every parameter's value (``Launcher.arguments``) as Triton's
    own launch path does (no launch hooks)."""
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                 None, None, None, *values)


def direct_launch(compiled):
    """``(launch, descriptor metadata by argument index)`` for calling a compiled kernel's C launcher
    without Triton 3.6's Python layers (``CudaLauncher.__call__``, and for kernels taking TMA
    descriptors the wrapper that encodes each descriptor at every launch); ``launch`` takes
    ``(grid x, y, z, stream, function, cooperative, pdl, None, None, packed metadata, None, None,
    None, *arguments)`` with each descriptor argument expanded as ``descriptor_arguments`` gives.
    None when the kernel needs launch scratch or its launcher is not laid out as in Triton 3.6
    (then ``run_compiled``)."""
    runner = getattr(compiled, "run", None)
    wrapped = getattr(runner, "launch", None)
    if wrapped is None or getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1):
        return None
    code = getattr(wrapped, "__code__", None)
    if code is None:                                    # the C function itself: no descriptors
        return wrapped, {}
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in wrapped.__closure__ or ())))
    if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
        return None
    indices = sorted(cells["tensordesc_indices"])
    return cells["launcher"], dict(zip(indices, cells["tensordesc_meta"]))


def descriptor_arguments(descriptor, meta) -> list:
    """A TMA descriptor argument as the C launcher takes it: ``[encoded map, *shape, *strides]``
    (Triton 3.6's ``make_tensordesc_arg``; the map is a driver call of ~1.5 us on the H200 host)."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return make_tensordesc_arg(descriptor, meta)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)     # Triton's own choice (CUDA builds)


def current_stream(device: int) -> int:
    return _RAW_STREAM(device) if _RAW_STREAM is not None else torch.cuda.current_stream(device).cuda_stream
