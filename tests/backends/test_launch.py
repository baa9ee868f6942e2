"""The cached launcher's key (backends/triton/launch.py) separates every pair of argument lists
that Triton 3.6 specializes differently: checked against Triton's own specialization on the CPU."""
import itertools

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from fastla.backends.triton.launch import Launcher, hooks_active  # noqa: E402


def _body(x, y, m, n, f, B: tl.constexpr):
    pass


def _body_with_default(x, m, B: tl.constexpr, C: tl.constexpr = 3):
    pass


def _kernel():
    from triton.runtime.jit import JITFunction     # compiled, even where the suite sets TRITON_INTERPRET

    return JITFunction(_body, do_not_specialize=["n"])


def _triton_spec(kernel, args):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    params = [p for p in kernel.params if not p.is_constexpr]
    return tuple(native_specialize_impl(backend, a, p.is_const, not p.do_not_specialize, True)
                 for a, p in zip(args, params))


def test_key_separates_what_triton_specializes(monkeypatch):
    import enum

    class Small(enum.IntEnum):
        ONE = 1
        SIXTEEN = 16
        SEVENTEEN = 17

    kernel = _kernel()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base.to(torch.bfloat16), base.to(torch.bfloat16)[3:]]     # aligned, not
    ints = [1, 2, 16, 17, 32, -16, 2 ** 31, 2 ** 31 - 16, 2 ** 63, Small.ONE, Small.SIXTEEN, Small.SEVENTEEN,
            True, False, None]
    launcher = Launcher(kernel)
    keys = {}
    for x, y, m, n in itertools.product(tensors, tensors[:2], ints, ints[:9]):
        args = (x, y, m, n, 0.5)
        key = launcher.key(args, {"B": 4})
        spec = _triton_spec(kernel, args)
        assert keys.setdefault(key, spec) == spec, (key, spec, keys[key])    # one key, one specialization
    assert len(set(keys.values())) > 20
    base_args = (base, base, 16, 7, 0.5)
    assert launcher.key(base_args, {"B": 4}) != launcher.key(base_args, {"B": 8})
    assert launcher.key(base_args + (4,), {}) != launcher.key(base_args + (8,), {})    # a positional constexpr


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


def test_cached_launch_passes_triton_arguments(monkeypatch):
    """The second launch of a specialization calls the compiled kernel's launcher with what
    Triton's JITFunction.run passes: the grid padded to three, the stream, the function, its
    metadata, no launch metadata or hooks, then every parameter in order (constexprs, defaults).
    A runtime argument by keyword, or a callable grid, goes through Triton each time."""
    from triton.runtime.jit import JITFunction

    from fastla.backends.triton import launch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda device: 1234)
    compiled, through_triton = _Compiled(), []

    class Triton:                                   # stands in for the kernel's own [grid](...) launch
        def __getitem__(self, grid):
            return lambda *a, **k: through_triton.append((grid, a, k)) or compiled

    launcher = Launcher(JITFunction(_body_with_default))
    launcher.fn = Triton()
    x = torch.zeros(8)
    for _ in range(3):
        launcher[(5,)](x, 7, B=2, num_warps=4)
    assert len(through_triton) == 1 and len(compiled.launches) == 2            # compiled once, then cached
    assert compiled.launches[0] == (5, 1, 1, 1234, "function", "metadata", None, None, None, x, 7, 2, 3)
    launcher[(5,)](x, m=7, B=2)                                                 # runtime m by keyword
    launcher[lambda meta: (5,)](x, 7, B=2)                                      # a callable grid
    assert len(through_triton) == 3 and len(compiled.launches) == 2
    launcher[(5, 2)](x, 7, B=3)                                                 # another constexpr: another key
    assert len(through_triton) == 4


def test_build_over_shared_memory_rebuilt_with_fewer_stages(monkeypatch):
    """A first launch that Triton refuses for shared memory is built again one stage fewer at a time
    (the first that fits is kept under the original key: later launches skip the refused builds);
    one refused at one stage, for another resource, or without an explicit num_stages (a Gluon
    kernel's buffers do not depend on it), raises."""
    from triton.runtime.errors import OutOfResources
    from triton.runtime.jit import JITFunction

    from fastla.backends.triton import launch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda device: 1234)
    compiled, builds = _Compiled(), []

    class Triton:                                   # fits at ``fits`` stages or fewer
        fits, resource = 2, "shared memory"

        def __getitem__(self, grid):
            def run(*a, num_stages=3, **k):
                builds.append(num_stages)
                if num_stages > self.fits:
                    raise OutOfResources(1000 * num_stages, 1000 * self.fits, self.resource)
                return compiled
            return run

    launcher = Launcher(JITFunction(_body_with_default))
    launcher.fn = triton = Triton()
    x = torch.zeros(8)
    for _ in range(2):
        launcher[(5,)](x, 7, B=2, num_warps=4, num_stages=4)
    assert builds == [4, 3, 2] and len(compiled.launches) == 1
    for constexpr, stages, fits, resource, tried in ((3, None, 2, "shared memory", [3]),     # none named
                                                     (4, 2, 0, "shared memory", [2, 1]),
                                                     (5, 2, 1, "tensor memory", [2])):
        builds.clear()
        triton.fits, triton.resource = fits, resource
        named = {} if stages is None else {"num_stages": stages}
        with pytest.raises(OutOfResources):
            launcher[(5,)](x, 7, B=constexpr, **named)
        assert builds == tried


def test_hooks_off_by_default_on_when_added():
    """Triton 3.6 always has a (usually empty) chain of launch hooks; only a non-empty one sends
    launches through Triton (which calls the hooks)."""
    from triton import knobs

    assert not hooks_active()
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton has no hook chain")

    def hook(*_):
        pass

    chain.add(hook)
    try:
        assert hooks_active()
    finally:
        chain.remove(hook)


def test_length_specialized_twin_only_for_aligned_multi_chunk_lengths():
    """T and NT are specialized (a compiled twin without do_not_specialize) only for T a multiple
    of 16 with more than one chunk: never the T = 1 or NT = 1 variants (docs/notes/gdn-prefill.md)."""
    from triton.runtime.jit import JITFunction

    from fastla.backends.triton.launch import launcher

    kernel = JITFunction(_body, do_not_specialize=["m", "n"])
    twin = launcher(kernel, 8192, 128).fn
    assert twin is not kernel and twin.fn is kernel.fn
    assert not any(p.do_not_specialize for p in twin.params)
    assert launcher(kernel, 32768, 512).fn is twin                              # one twin per kernel
    for T, NT in ((1, 1), (64, 1), (200, 4), (8191, 128)):
        assert launcher(kernel, T, NT).fn is kernel, (T, NT)
