"""Where a job's memory goes: the bytes of a model's parameters, of their
gradients and of its optimizer's state on each CUDA device, by dtype.

Everything here is duck-typed: torch is never imported, and nothing is asked
of CUDA. A tensor is anything with ``.device`` (``.type``, ``.index``) and
``.dtype``; its resident bytes are those of its storage
(``untyped_storage().nbytes()``), counted once per storage, so that tied
parameters and views into one flat buffer are not counted twice. Objects
without ``untyped_storage()`` count ``numel() * element_size()`` once per
object.

The reporter thread calls :func:`read_composition` every few seconds; the
training thread may change the model or the optimizer's state meanwhile, so
every container is copied with ``list(...)`` before it is walked, and a walk
that still meets a concurrent change raises RuntimeError to its caller, which
retries once.
"""

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

PARAMS = "params"
GRADS = "grads"
OPTIMIZER = "optimizer"
PARTS = (PARAMS, GRADS, OPTIMIZER)

# The device index CPU tensors are counted under when ``count_cpu`` is true
# (never sent: the wire only has CUDA device indices, which are >= 0).
CPU_INDEX = -1

# How many wrapper levels (DeepSpeed engine optimizers, accelerate's
# AcceleratedOptimizer, LR schedulers) are looked through to find ``state``.
MAX_UNWRAP = 3

# {device index: {part: {dtype name: bytes}}}
Composition = Dict[int, Dict[str, Dict[str, int]]]
Ref = Callable[[], Any]


# -- holding what is tracked ---------------------------------------------------


class _Strong:
    """A strong reference with weakref.ref's call interface, for objects that
    cannot be weakly referenced."""

    __slots__ = ("_obj",)

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __call__(self) -> Any:
        return self._obj


def _ref(obj: Any) -> Ref:
    try:
        return weakref.ref(obj)
    except TypeError:
        return _Strong(obj)


def _is_module(obj: Any) -> bool:
    return callable(getattr(obj, "parameters", None))


def _is_optimizer(obj: Any) -> bool:
    return hasattr(obj, "state") or hasattr(obj, "optimizer")


def hold(obj: Any, what: str) -> Optional[Tuple[Ref, ...]]:
    """References to a model (``what="model"``) or an optimizer
    (``what="optimizer"``), or to each one of a list or tuple of them.

    Returns None for an empty list or tuple (nothing tracked). Raises
    TypeError for anything that is not a module (an object with a callable
    ``parameters()``) or an optimizer (an object with ``state``, or an
    ``optimizer`` attribute to look through).
    """
    check = _is_module if what == "model" else _is_optimizer
    if isinstance(obj, (list, tuple)):
        items = list(obj)
    else:
        items = [obj]
    for item in items:
        if not check(item):
            if what == "model":
                raise TypeError(
                    "model must be a module (an object with a parameters() method) "
                    "or a list of modules, not %r" % (type(item).__name__,)
                )
            raise TypeError(
                "optimizer must be an optimizer (an object with a state mapping) "
                "or a list of optimizers, not %r" % (type(item).__name__,)
            )
    if not items:
        return None
    return tuple(_ref(item) for item in items)


def alive(refs: Optional[Tuple[Ref, ...]]) -> Optional[List[Any]]:
    """The tracked objects still alive, or None when nothing is tracked or all
    of them are gone (their part is then unknown)."""
    if refs is None:
        return None
    objs = [obj for obj in (ref() for ref in refs) if obj is not None]
    return objs or None


# -- counting ------------------------------------------------------------------


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``. The wire checks the name."""
    text = str(dtype)
    if text.startswith("torch."):
        return text[6:]
    return text


class _Counter:
    """Counts tensors into per-device, per-part, per-dtype bytes, each storage
    (or, failing that, each object) once across all parts."""

    def __init__(self, count_cpu: bool) -> None:
        self.count_cpu = count_cpu
        self.seen = set()  # type: set
        # Objects counted by id() are kept alive until the walk ends, so that
        # an id cannot be reused by a new object during the walk.
        self.keep = []  # type: List[Any]
        self.devices = {}  # type: Dict[int, Dict[str, Dict[str, int]]]
        self.names = {}  # type: Dict[Any, str]

    def _index(self, tensor: Any) -> Optional[int]:
        device = getattr(tensor, "device", None)
        kind = getattr(device, "type", None)
        if kind == "cuda":
            index = getattr(device, "index", None)
            if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
                return index
            return None
        if kind == "cpu" and self.count_cpu:
            return CPU_INDEX
        return None

    def _name(self, dtype: Any) -> str:
        try:
            name = self.names.get(dtype)
        except TypeError:  # an unhashable dtype
            return dtype_name(dtype)
        if name is None:
            name = dtype_name(dtype)
            self.names[dtype] = name
        return name

    def add(self, obj: Any, part: str, parts: Iterable[str]) -> None:
        """Count one tensor-like ``obj`` (its local shard when it is a
        DTensor-like wrapper) under ``part``; anything else is ignored.
        ``parts`` are the parts known, created empty on a device seen first."""
        if obj is None:
            return
        local = _local_shard(obj)
        if local is None:
            return
        index = self._index(local)
        if index is None:
            return
        dtype = getattr(local, "dtype", None)
        if dtype is None:
            return
        nbytes = self._resident_bytes(local, index)
        device = self.devices.get(index)
        if device is None:
            device = self.devices[index] = {name: {} for name in parts}
        if nbytes:
            by_dtype = device[part]
            name = self._name(dtype)
            by_dtype[name] = by_dtype.get(name, 0) + nbytes

    def _resident_bytes(self, tensor: Any, index: int) -> int:
        """Bytes not counted yet: the whole storage the first time it is met,
        0 afterwards (and 0 for an empty storage)."""
        storage_of = getattr(tensor, "untyped_storage", None)
        if callable(storage_of):
            try:
                storage = storage_of()
                nbytes = int(storage.nbytes())
                if nbytes <= 0:
                    return 0
                key = (index, int(storage.data_ptr()))
            except Exception:
                pass  # no storage to look at (sparse, wrapper subclasses): by size
            else:
                if key in self.seen:
                    return 0
                self.seen.add(key)
                return nbytes
        key = ("id", id(tensor))
        if key in self.seen:
            return 0
        try:
            nbytes = int(tensor.numel()) * int(tensor.element_size())
        except Exception:
            return 0
        self.seen.add(key)
        self.keep.append(tensor)
        return max(0, nbytes)


def _local_shard(obj: Any) -> Any:
    """What of ``obj`` this process holds: a DTensor's local shard (its
    ``_local_tensor`` when present, which needs no autograd, else
    ``to_local()``), otherwise ``obj`` itself when it is tensor-like."""
    to_local = getattr(obj, "to_local", None)
    if callable(to_local):
        local = getattr(obj, "_local_tensor", None)
        if local is None:
            try:
                local = to_local()
            except Exception:
                return None
        obj = local
    if hasattr(obj, "device") and hasattr(obj, "dtype"):
        return obj
    return None


def _copy(items: Iterable[Any]) -> List[Any]:
    # list() of a dict view or of a generator over the training thread's
    # containers raises RuntimeError if they change meanwhile.
    return list(items)


def _parameters(model: Any) -> List[Any]:
    return _copy(model.parameters())


def _state(optimizer: Any) -> Any:
    """The ``state`` mapping of an optimizer, looking through up to
    ``MAX_UNWRAP`` wrappers that only have an ``.optimizer``."""
    for _ in range(MAX_UNWRAP + 1):
        state = getattr(optimizer, "state", None)
        if state is not None:
            return state
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return None
    return None


def _state_tensors(state: Any) -> List[Any]:
    """The values held in an optimizer's state: ``state`` maps each parameter
    to a dict of name -> value; values that are lists or tuples are looked
    into one level."""
    values = getattr(state, "values", None)
    if not callable(values):
        return []
    out = []  # type: List[Any]
    for entry in _copy(values()):
        inner = getattr(entry, "values", None)
        if callable(inner) and not hasattr(entry, "dtype"):
            items = _copy(inner())
        else:
            items = [entry]
        for item in items:
            if isinstance(item, (list, tuple)):
                out.extend(item)
            else:
                out.append(item)
    return out


def read_composition(
    models: Optional[Iterable[Any]],
    optimizers: Optional[Iterable[Any]],
    count_cpu: bool = False,
) -> Composition:
    """Bytes of parameters, gradients and optimizer state per device and dtype.

    ``models`` and ``optimizers`` are live objects, or None when not tracked:
    then their parts are left out (unknown). Every device on which at least one
    counted tensor lives gets every known part, ``{}`` when it holds none of
    that part. Only CUDA tensors count, unless ``count_cpu`` (for tests and
    the benchmark), which counts CPU tensors under ``CPU_INDEX``.

    One walk, O(number of tensors). Raises RuntimeError when the training
    thread changes a container during the walk; the caller retries.
    """
    parts = []  # type: List[str]
    if models is not None:
        parts += [PARAMS, GRADS]
    if optimizers is not None:
        parts.append(OPTIMIZER)
    counter = _Counter(count_cpu)
    if models is not None:
        params = []  # type: List[Any]
        for model in models:
            params.extend(_parameters(model))
        for param in params:
            # DeepSpeed ZeRO-3: the resident partition, plus whatever is
            # gathered right now (an empty storage when not).
            counter.add(getattr(param, "ds_tensor", None), PARAMS, parts)
            counter.add(param, PARAMS, parts)
        for param in params:
            counter.add(getattr(param, "grad", None), GRADS, parts)
    if optimizers is not None:
        for optimizer in optimizers:
            for value in _state_tensors(_state(optimizer)):
                counter.add(value, OPTIMIZER, parts)
    return counter.devices


def read_with_retry(
    models: Optional[Iterable[Any]],
    optimizers: Optional[Iterable[Any]],
    count_cpu: bool = False,
) -> Composition:
    """:func:`read_composition`, once more when the first walk met a change
    made by the training thread. A second RuntimeError propagates."""
    models = None if models is None else list(models)
    optimizers = None if optimizers is None else list(optimizers)
    try:
        return read_composition(models, optimizers, count_cpu)
    except RuntimeError:
        return read_composition(models, optimizers, count_cpu)
