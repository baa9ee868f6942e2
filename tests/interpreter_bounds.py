"""Out-of-bounds accesses caught in the Triton interpreter. A kernel's load, store or atomic whose
active lanes (mask on) address memory outside every tensor argument's storage raises, naming the
kernel and program; the interpreter otherwise reads whatever the host heap holds there (a GPU
faults: "illegal memory access", which loses the CUDA context and names no kernel). The test suite
installs it for every interpreter run (tests/conftest.py); ``FASTLA_BOUNDS_CHECK=0`` leaves it out.

What it cannot see: an address inside another argument's storage, or inside the right storage but
outside the view (a wrong row of the right tensor): the value checks catch those."""
import numpy as np
from triton.runtime import interpreter

_STORAGES: list[tuple[int, int]] = []     # [(first byte, one past the last)] of the running launch
_KERNEL = [""]                            # its kernel's name


class OutOfBounds(RuntimeError):
    pass


def _storages_of(arg, into: list) -> None:
    if isinstance(arg, (tuple, list)):
        for a in arg:
            _storages_of(a, into)
    elif hasattr(arg, "base") and hasattr(arg, "block_shape"):      # a tensor descriptor
        _storages_of(arg.base, into)
    elif hasattr(arg, "untyped_storage"):
        s = arg.untyped_storage()
        into.append((s.data_ptr(), s.data_ptr() + s.nbytes()))


def _check(ptrs, mask, element, what: str) -> None:
    addresses = np.asarray(ptrs.data).astype(np.uint64)
    active = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    if active.size == 0:
        return
    width = np.uint64(np.dtype(interpreter._get_np_dtype(element)).itemsize)
    inside = np.zeros(active.shape, dtype=bool)
    for lo, hi in _STORAGES:
        inside |= (active >= np.uint64(lo)) & (active + width <= np.uint64(hi))
    if not inside.all():
        outside = [int(a) for a in active[~inside][:3]]
        nearest = [min(((a - lo, hi - lo) for lo, hi in _STORAGES), key=lambda d: min(abs(d[0]), abs(d[0] - d[1])))
                   for a in outside]
        raise OutOfBounds(f"{what} out of bounds in {_KERNEL[0]}, program {interpreter.interpreter_builder.grid_idx}: "
                          f"{int((~inside).sum())} of {active.size} lanes; (byte offset from the nearest storage, "
                          f"its size): {nearest}")


def install() -> None:
    """Check every launch of this process from now on (idempotent)."""
    Builder, Executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    if getattr(Builder, "_fastla_bounds", False):
        return
    load, store, rmw, init = (Builder.create_masked_load, Builder.create_masked_store, Builder.create_atomic_rmw,
                              Executor._init_args_hst)

    def init_args(self, args_dev, kwargs):
        args, kw = init(self, args_dev, kwargs)
        _STORAGES.clear()
        _storages_of(list(args) + list(kw.values()), _STORAGES)
        _KERNEL[0] = getattr(self.fn, "__name__", str(self.fn))
        return args, kw

    def masked_load(self, ptrs, mask, other, *rest):
        _check(ptrs, mask, ptrs.get_element_ty(), "load")
        return load(self, ptrs, mask, other, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        _check(ptrs, mask, ptrs.get_element_ty(), "store")
        return store(self, ptrs, value, mask, *rest)

    def atomic_rmw(self, op, ptr, val, mask, *rest):
        _check(ptr, mask, ptr.get_element_ty(), "atomic")
        return rmw(self, op, ptr, val, mask, *rest)

    Executor._init_args_hst = init_args
    Builder.create_masked_load, Builder.create_masked_store, Builder.create_atomic_rmw = masked_load, masked_store, atomic_rmw
    Builder._fastla_bounds = True
