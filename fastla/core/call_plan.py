"""Whole-call plans: a public op's kernel launches recorded at the second call with a signature,
and replayed by later calls with that signature, which then skip validation, tier selection,
launch planning and the launch keys (the host path of one GDN prefill call took 180-230 us on the
H200 machine's host; docs/notes/gdn-prefill.md). A recording costs ~2.5x the full path (517 vs
209 us on the CPU stub, 1x8k HV8), so a signature seen once is only noted: a stream of calls
whose signatures never repeat (varlen batches of new lengths) pays the signature alone.

Signature (the plan's key): for each argument, a CUDA tensor's shape, strides, dtype, device and
16-byte alignment; a CPU tensor's values (``cu_seqlens_cpu``; up to ``CPU_VALUES`` elements); a
number, bool, string or None by type and value; plus the grad mode, the tier forced by
``use_tier`` / ``FASTLA_BACKEND`` and the current CUDA device. Anything else (another object, a
tensor subclass, a tensor that requires grad while grad is enabled) leaves the call unplanned, as
does a call without a CUDA tensor. ``FASTLA_CALL_PLANS=0`` (or ``ENABLED = False``) turns plans off.

Recording (the second call with a signature) runs the call's full path with a recorder set:
``Launcher`` (backends/triton/launch.py) reports each launch (compiled kernel, grid, every
argument); ``empty`` and ``full`` below note the allocations; ``keep_constants`` notes the
host-built index tables (kept alive by the plan); ``value_check`` runs validations that read input
values on the host (the plan runs them again at every replay); ``dense`` notes the copies of inputs
that the kernels cannot read as they are (strided or misaligned views; replayed before the
launches); a TorchDispatchMode watches every aten op. The call is left unplanned (and takes its
full path every time) when an aten op reads or writes a CUDA tensor's data outside ``full``,
``dense``, ``unwatched`` and ``value_check`` (a copy, a cast, a reduction), when a launch bypasses
the cached launcher (the interpreter, launch hooks), when a launch argument is a tensor that is none of the call's inputs (by identity), allocations
and constants, or when the result holds anything but those, views of them and None.
Plain launch arguments (ints, floats, constexprs) are kept as recorded: the full path derives
them from the signature.

A call may put some launches on a second stream (GDN's pipeline, backends/gluon/chunk_delta.py)
through ``fork``, ``record_event``, ``wait_event`` and ``join`` below: each does its stream
operation and a recording notes it in order with the launches, which note the stream they ran on;
a replay runs those launches on that (persistent) stream, the others on the caller's, and the
same stream operations in the same order, with events of the plan's own.

Replay runs the kept value checks, allocates (the result's tensors, and one workspace for all
scratch), fills each launch's recorded arguments with the new call's addresses, calls each
compiled kernel's C launcher directly (``launch.direct_launch``; TMA maps encoded once per slot and
address, then kept) and returns the result. Calls during CUDA-graph capture (the full path pins the tables the
graph keeps), under ``torch.compile`` tracing, with launch hooks on or ``launch.CACHED`` off take
the full path. Code that changes fastla's plan choices between calls (tests patching module
attributes, sweeps setting tile knobs) must ``clear()`` the plans or set ``ENABLED = False``.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import OrderedDict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastla.core import dispatch

ENABLED = os.environ.get("FASTLA_CALL_PLANS", "1") != "0"
LIMIT = 512                 # plans (and signatures seen once) kept, the oldest dropped first
CPU_VALUES = 4096           # a CPU tensor argument's values enter the key up to this many elements
_PLANS: OrderedDict = OrderedDict()     # signature -> plan, or a string saying why it is not planned
_SEEN: OrderedDict = OrderedDict()      # signatures called once (recorded at their second call)
_local = threading.local()
_Tensor = torch.Tensor
_TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)
_PLAIN = (type(None), bool, int, float, str)
_aten = torch.ops.aten
# aten ops that touch no tensor data: allocations and views
_METADATA_OPS = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.view.default, _aten._unsafe_view.default, _aten.as_strided.default,
    _aten.alias.default, _aten.slice.Tensor, _aten.select.int, _aten.unsqueeze.default, _aten.squeeze.dim,
    _aten.squeeze.default, _aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.expand.default,
    _aten.detach.default, _aten.split.Tensor, _aten.unbind.int,
}
_FILL_OPS = {_aten.fill_.Scalar, _aten.zero_.default}


class _DevicePart:
    """Marks a device tensor's part of a signature (equal to itself only)."""


_DEVICE_PART = _DevicePart()


class _Unplanned(Exception):
    """Raised while building a key: the call takes its full path."""


def clear() -> None:
    """Drop every plan (after changing module-level plan choices)."""
    _PLANS.clear()
    _SEEN.clear()


def planned(fn):
    """Decorator for a public op: calls with a signature seen before replay its recorded plan."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not ENABLED or getattr(_local, "recording", None) is not None or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        try:
            key = (fn, _signature(args, kwargs))
        except _Unplanned:
            return fn(*args, **kwargs)
        plan = _PLANS.get(key, _MISSING)
        if plan is _MISSING and _SEEN.pop(key, _MISSING) is _MISSING:   # a first sighting: noted
            _bounded_insert(_SEEN, key, None)
            return fn(*args, **kwargs)
        if plan.__class__ is str or _full_path_only():       # a string: why the call is not planned
            return fn(*args, **kwargs)
        if plan is _MISSING:
            return _record(fn, key, args, kwargs)
        return plan.run(args, kwargs)

    # the plan of a signature: None if not recorded yet, a string saying why it is not planned
    call.plan_of = lambda *args, **kwargs: _PLANS.get((fn, _signature(args, kwargs)))
    return call


_MISSING = object()


def _bounded_insert(table: OrderedDict, key, value) -> None:
    if len(table) >= LIMIT:
        table.popitem(last=False)                   # the oldest
    table[key] = value


def _signature(args, kwargs) -> tuple:
    grad = torch.is_grad_enabled()
    parts = [grad, dispatch.forced_state(), torch.cuda.is_initialized() and torch.cuda.current_device()]
    device = False
    for a in args:
        part = _part(a, grad)
        device = device or part[0] is _DEVICE_PART
        parts.append(part)
    for name, a in kwargs.items():
        part = _part(a, grad)
        device = device or part[0] is _DEVICE_PART
        parts += (name, part)
    if not device:                      # a call on CPU tensors (the torch tier): nothing to replay
        raise _Unplanned
    return tuple(parts)


def _part(a, grad: bool):
    c = a.__class__
    if c in _PLAIN:
        return c, a
    if c not in _TENSOR_CLASSES:
        raise _Unplanned
    if grad and a.requires_grad:
        raise _Unplanned
    if _on_device(a):
        return _DEVICE_PART, a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() & 15
    if a.device.type != "cpu" or a.numel() > CPU_VALUES:
        raise _Unplanned
    return a.shape, a.dtype, tuple(a.tolist() if a.dim() == 1 else a.reshape(-1).tolist())


def _on_device(x: torch.Tensor) -> bool:
    """Whether a tensor's data lives on the GPU (its values never enter a key; fastla/bench/
    host_stub.py redefines this to run the plans on CPU tensors)."""
    return x.is_cuda


def _full_path_only() -> bool:
    from fastla.backends.triton import launch

    if not launch.CACHED or launch.hooks_active():
        return True
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


# --- recording -------------------------------------------------------------------------------

class _Recording:
    def __init__(self):
        self.launches = []          # (compiled kernel, grid, argument values, stream), or a _StreamStep
        self.allocations = {}       # id -> (tensor, fill value or None), in allocation order
        self.constants = {}         # id -> tensor
        self.checks = []            # (value check, ids of its tensors, constants)
        self.copies = []            # (id of the input, id of its dense copy), in call order
        self.views = []             # (view, the tensor it views), noted by ``note_view``
        self.paused = 0
        self.why_not = None

    def unplanned(self, why: str) -> None:
        if self.why_not is None:
            self.why_not = why


class _StreamStep:
    """A stream operation between launches: ``fork`` (``side`` waits for the caller's stream),
    ``record`` (``event`` recorded on ``side``), ``wait`` (the caller's stream waits for
    ``event``) or ``join`` (the caller's stream waits for ``side``)."""

    def __init__(self, kind: str, side=None, event=None):
        self.kind, self.side, self.event = kind, side, event

    def __call__(self, event=None):
        main = torch.cuda.current_stream(self.side.device if self.side is not None else None)
        if self.kind == "fork":
            self.side.wait_stream(main)
        elif self.kind == "record":
            event.record(self.side)
        elif self.kind == "wait":
            main.wait_event(event)
        else:
            main.wait_stream(self.side)


def _stream_step(kind: str, side, event=None) -> None:
    step = _StreamStep(kind, side, event)
    step(event)
    rec = recording()
    if rec is not None:
        rec.launches.append(step)


def note_view(view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``view`` (a view of ``base`` made inside the call: a piece's rows) for a recording: a launch
    argument over it is replayed at the new call's ``base`` plus the same byte offset. Returns it."""
    rec = recording()
    if rec is not None:
        rec.views.append((view, base))
    return view


def fork(side: torch.cuda.Stream) -> None:
    """``side`` waits for the caller's stream (noted by a recording)."""
    _stream_step("fork", side)


def record_event(event: torch.cuda.Event, side: torch.cuda.Stream) -> None:
    """``event`` recorded on ``side`` (noted by a recording)."""
    _stream_step("record", side, event)


def wait_event(event: torch.cuda.Event, side: torch.cuda.Stream) -> None:
    """The caller's stream waits for ``event`` (recorded on ``side``; noted by a recording)."""
    _stream_step("wait", side, event)


def join(side: torch.cuda.Stream) -> None:
    """The caller's stream waits for ``side`` (noted by a recording)."""
    _stream_step("join", side)


def recording() -> _Recording | None:
    """The recording in progress on this thread (Launcher reports its launches to it)."""
    return getattr(_local, "recording", None)


def empty(shape, dtype, device, fill=None) -> torch.Tensor:
    """``torch.empty`` (``torch.full`` with ``fill``) for a kernel's output or scratch, noted by a
    recording (a fill is replayed)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    rec = recording()
    if rec is not None:
        rec.allocations[id(t)] = (t, fill)
    if fill is not None:
        t.fill_(fill)
    return t


def full(shape, value: float, dtype, device) -> torch.Tensor:
    """``torch.full``, noted by a recording (the fill is replayed)."""
    return empty(shape, dtype, device, fill=value)


@contextlib.contextmanager
def unwatched():
    """Host work whose device ops a recording does not flag: the build of host-made index tables
    (their copies to the device) and ``value_check``'s reads."""
    rec = recording()
    if rec is not None:
        rec.paused += 1
    try:
        yield
    finally:
        if rec is not None:
            rec.paused -= 1


def dense(x: torch.Tensor | None, align: int = 1) -> torch.Tensor | None:
    """``x`` itself when it is contiguous and its address a multiple of ``align`` bytes, else a
    contiguous copy (an input that a kernel reads as a dense row-major array: a strided view such as
    q, k, v split from one projection, FLA's ``input_guard`` does the same); a recording notes the
    copy, which must be of a call's input, and the plan replays it before the launches."""
    if x is None or (x.is_contiguous() and x.data_ptr() % align == 0):
        return x
    t = empty(x.shape, x.dtype, x.device)
    with unwatched():
        t.copy_(x)
    rec = recording()
    if rec is not None:
        rec.copies.append((id(x), id(t)))
    return t


def value_check(check, tensors: tuple, **constants) -> None:
    """Run ``check(*tensors, **constants)``, a validation that reads the tensors' values on the
    host and raises ValueError; a recording keeps it (its reads are not flagged) and the plan runs
    it again at every replay on that call's tensors, which must be the call's inputs."""
    with unwatched():
        check(*tensors, **constants)
    rec = recording()
    if rec is not None:
        rec.checks.append((check, [id(t) for t in tensors], constants))


def keep_constants(*tensors) -> None:
    """Note index tables (built once per key, cached) as constants of a recording in progress:
    the plan passes them as they are (and keeps them alive)."""
    rec = recording()
    if rec is not None:
        rec.constants.update((id(t), t) for t in tensors if isinstance(t, _Tensor))


class _Watch(TorchDispatchMode):
    """Flags aten ops that touch a CUDA tensor's data during a recording."""

    def __init__(self, rec: _Recording):
        super().__init__()
        self.rec = rec

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo by default, whose first
        # call imports torch._dynamo (~0.9 s); recordings never run under torch.compile
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.rec
        if rec.paused or func in _METADATA_OPS or rec.why_not is not None:
            return out
        if func in _FILL_OPS and id(args[0]) in rec.allocations:
            return out
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, _Tensor)]
        tensors += out if isinstance(out, (tuple, list)) else [out]
        if any(isinstance(x, _Tensor) and _on_device(x) for x in tensors):
            rec.unplanned(f"the aten op {func} touches a device tensor's data")
        return out


def _record(fn, key, args, kwargs):
    rec = _Recording()
    _local.recording = rec
    try:
        with _Watch(rec):
            result = fn(*args, **kwargs)
    finally:
        _local.recording = None
    plan = rec.why_not
    if plan is None:
        try:
            plan = _Plan(rec, args, kwargs, result)
        except _Unplanned as exc:
            plan = str(exc)
    _bounded_insert(_PLANS, key, plan)
    return result


# --- the plan ----------------------------------------------------------------------------------

_SAME, _VIEW = 0, 1          # a result item: a tensor of the call as it is, or a view of an allocation
WORKSPACE_ALIGN = 256        # bytes; each scratch buffer's offset in the call's workspace
ENCODED_LIMIT = 4096         # encoded TMA maps kept per plan (by slot and address)
_GENERIC = object()          # a descriptor passed as an object (the launch goes through run_compiled)


class _Address(int):
    """A device address standing for a tensor: the launchers take ints for pointer arguments, and
    a TMA descriptor's base needs only ``data_ptr``."""

    def data_ptr(self) -> int:
        return self


class _Plan:
    """The launches of one call signature, with the slots the next call's tensors fill.

    Slot numbering: the call's input tensors (``paths``: argument positions or keyword names),
    then the allocations in the order the full path made them. Allocations that the result holds
    (or that are filled) are tensors of their own; the rest, scratch read only by the launches,
    share one byte workspace (one allocation per call instead of one per buffer)."""

    def __init__(self, rec: _Recording, args, kwargs, result):
        from fastla.backends.triton import launch

        if not rec.launches:
            raise _Unplanned("no kernel launch was recorded")
        inputs = {}
        for path, a in [*enumerate(args), *kwargs.items()]:
            if isinstance(a, _Tensor):
                if id(a) in inputs:
                    raise _Unplanned("one tensor passed as two arguments")
                inputs[id(a)] = path
        self.paths = list(inputs.values())
        n_in = len(self.paths)
        sources = {obj: i for i, obj in enumerate(inputs)}
        allocs = list(rec.allocations.values())
        if any(i not in sources for _, ids, _ in rec.checks for i in ids):
            raise _Unplanned("a value check reads a tensor that is not an input")
        if any(i not in sources for i, _ in rec.copies):
            raise _Unplanned("a dense copy of a tensor that is not an input")
        self.checks = [(check, [sources[i] for i in ids], constants) for check, ids, constants in rec.checks]
        sources.update((id(t), n_in + j) for j, (t, _) in enumerate(allocs))
        # (input slot, copy slot): the copies are tensors of their own, filled before the launches
        self.copies = [(sources[i], sources[c]) for i, c in rec.copies]
        self.result = self._result_spec(result, sources, allocs, n_in)
        kept = {s[1] for s in self.result[1] if s is not None} | {c for _, c in self.copies}
        # per allocation: (shape, dtype, fill) for a tensor of its own, or its workspace offset
        self.allocations, offset = [], 0
        for j, (t, fill) in enumerate(allocs):
            if fill is not None or n_in + j in kept:
                self.allocations.append((tuple(t.shape), t.dtype, fill))
            else:
                self.allocations.append(offset)
                offset += -(-t.numel() * t.element_size() // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
        self.workspace = offset
        # noted views: (their base's slot, byte offset), bases resolved in the order noted
        views: dict = {}
        for view, base in rec.views:
            at = (sources[id(base)], 0) if id(base) in sources else views.get(id(base))
            if at is not None:
                views[id(view)] = (at[0], at[1] + view.data_ptr() - base.data_ptr())
        self.device = None
        # the recorded launches and stream steps in order; a launch on a side stream of a fork
        # keeps that stream, the rest take the caller's at each replay (None); each recorded event
        # gets one of the plan's own
        sides = {step.side.cuda_stream for step in rec.launches if isinstance(step, _StreamStep)}
        events: dict = {}
        self.launches = []
        for step in rec.launches:
            if isinstance(step, _StreamStep):
                event = step.event and events.setdefault(id(step.event), torch.cuda.Event())
                self.launches.append((step, event))
                continue
            compiled, grid, values, stream = step
            self.launches.append(self._launch(launch, compiled, grid, values, rec.constants, sources, views,
                                              stream if stream in sides else None))
        self.kernels = [getattr(step[0], "name", "?") for step in rec.launches if not isinstance(step, _StreamStep)]
        if self.device is None:
            raise _Unplanned("no CUDA tensor among the launch arguments")
        self.stream = launch.current_stream
        self.current_device = torch.cuda.current_device()          # whose stream Launcher launches on
        self.encoded = {}                   # (launch, argument position, address) -> encoded TMA map

    def _launch(self, launch, compiled, grid, values, constants, sources, views, side):
        """One launch as (function, argument template, slots, where the stream goes, its side
        stream or None): the compiled kernel's C launcher with descriptors expanded
        (``launch.direct_launch``), or else ``launch.run_compiled``. A slot is (position, source
        slot, descriptor fields, byte offset: a noted view's)."""
        def source(x):
            return (sources[id(x)], 0) if id(x) in sources else views.get(id(x))

        grid = (tuple(grid) + (1, 1))[:3]
        direct = launch.direct_launch(compiled)
        if direct is None:
            def fn(compiled, grid, stream, *values):
                launch.run_compiled(compiled, grid, stream, values)
            template, stream_at, metas, offset = [compiled, grid, None, *values], 2, {}, 3
        else:
            fn, metas = direct
            template = [*grid, None, compiled.function, compiled.run.launch_cooperative_grid,
                        compiled.run.launch_pdl, None, None, compiled.packed_metadata, None, None, None]
            stream_at, offset = 3, None
        slots = []
        for pos, v in enumerate(values):
            at = offset + pos if offset is not None else len(template)
            if isinstance(v, _Tensor) and id(v) not in constants:
                src = source(v)
                if src is None:
                    raise _Unplanned(f"launch argument {pos} is a tensor the plan cannot rebuild")
                slots.append((at, src[0], None, src[1]))
                self.device = v.device if _on_device(v) else self.device
                v = None
            elif hasattr(v, "block_shape") and hasattr(v, "base"):          # a TMA descriptor
                src = source(v.base)
                if src is None:
                    raise _Unplanned(f"launch argument {pos} is a TMA descriptor over an unknown tensor")
                if direct is not None and pos not in metas:
                    raise _Unplanned(f"launch argument {pos} is a descriptor the C launcher does not expand")
                fields = {n: x for n, x in vars(v).items() if n != "base"}
                slots.append((at, src[0], (v.__class__, fields, metas.get(pos, _GENERIC)), src[1]))
                if pos in metas:                                # [map, *shape, *strides]: the map per call
                    template += [None, *launch.descriptor_arguments(v, metas[pos])[1:]]
                    continue
                v = None
            if offset is None:
                template.append(v)
            else:
                template[at] = v
        return fn, template, slots, stream_at, side

    @staticmethod
    def _result_spec(result, sources, allocs, n_in):
        storages = {t.untyped_storage().data_ptr(): j for j, (t, _) in enumerate(allocs)}

        def spec(x):
            if x is None:
                return None
            if not isinstance(x, _Tensor):
                raise _Unplanned(f"the result holds a {type(x).__name__}")
            if id(x) in sources:
                return _SAME, sources[id(x)]
            j = storages.get(x.untyped_storage().data_ptr())
            if j is None:
                raise _Unplanned("the result holds a tensor that is no input or allocation")
            return _VIEW, n_in + j, tuple(x.shape), x.stride(), x.storage_offset()

        if isinstance(result, tuple):
            return tuple, [spec(x) for x in result]
        return None, [spec(result)]

    def run(self, args, kwargs):
        for check, slots, constants in self.checks:
            paths = [self.paths[i] for i in slots]
            check(*[args[p] if p.__class__ is int else kwargs[p] for p in paths], **constants)
        tensors, calls, workspace = self.bind(args, kwargs)        # noqa: F841 (alive until launched)
        for fn, values in calls:
            fn(*values)
        kind, spec = self.result
        out = [None if s is None else self._value(s, tensors) for s in spec]
        return tuple(out) if kind is tuple else out[0]

    def bind(self, args, kwargs):
        """(the call's tensors by slot, [(launch function, its arguments)], the scratch workspace:
        to be kept until the launches are issued; after that its memory is reused in stream order,
        as any temporary's)."""
        tensors = [args[p] if p.__class__ is int else kwargs[p] for p in self.paths]
        # the launches take addresses (ints skip the launcher's per-pointer driver query)
        addresses = [_Address(t.data_ptr()) for t in tensors]
        device = self.device
        workspace = None
        if self.workspace:
            workspace = torch.empty(self.workspace, dtype=torch.uint8, device=device)
            base = workspace.data_ptr()
        for a in self.allocations:
            if a.__class__ is int:
                addresses.append(_Address(base + a))
                tensors.append(None)
                continue
            t = torch.empty(a[0], dtype=a[1], device=device)
            if a[2] is not None:
                t.fill_(a[2])
            tensors.append(t)
            addresses.append(_Address(t.data_ptr()))
        stream = self.stream(self.current_device)
        calls = [(_Tensor.copy_, (tensors[c], tensors[i])) for i, c in self.copies]   # (torch's current stream)
        for i, step in enumerate(self.launches):
            if step[0].__class__ is _StreamStep:
                calls.append((step[0], (step[1],)))
                continue
            fn, template, slots, stream_at, side = step
            values = template.copy()
            values[stream_at] = stream if side is None else side
            for at, src, desc, offset in slots:
                address = _Address(addresses[src] + offset) if offset else addresses[src]
                values[at] = address if desc is None else self._descriptor(i, at, address, desc)
            calls.append((fn, values))
        return tensors, calls, workspace

    def _descriptor(self, launch: int, at: int, address: int, desc):
        """A TMA descriptor over ``address``: the object, or for a direct launch its encoded map
        (kept per address: the same slot over the same address encodes the same map)."""
        cls, fields, meta = desc
        if meta is not _GENERIC:
            key = (launch, at, address)
            encoded = self.encoded.get(key)
            if encoded is not None:
                return encoded
        d = cls.__new__(cls)
        d.__dict__.update(fields)
        d.base = address
        if meta is _GENERIC:
            return d
        from fastla.backends.triton.launch import descriptor_arguments

        if len(self.encoded) >= ENCODED_LIMIT:
            self.encoded.clear()
        encoded = self.encoded[key] = descriptor_arguments(d, meta)[0]
        return encoded

    @staticmethod
    def _value(s, tensors):
        if s[0] == _SAME:
            return tensors[s[1]]
        _, j, shape, stride, offset = s
        t = tensors[j]
        if t.shape == shape and offset == 0 and t.stride() == stride:
            return t
        return t.as_strided(shape, stride, offset)
