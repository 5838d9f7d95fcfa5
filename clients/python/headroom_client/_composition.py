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
    (or, failing that, each object) once across all parts.

    Written for speed: it runs once per tensor of the model. Methods
    (``to_local``, ``untyped_storage``) are looked up once per type, as
    Python looks up special methods."""

    def __init__(self, count_cpu: bool) -> None:
        self.count_cpu = count_cpu
        self.seen = set()  # type: set
        # Objects counted by id() are kept alive until the walk ends, so that
        # an id cannot be reused by a new object during the walk.
        self.keep = []  # type: List[Any]
        self.devices = {}  # type: Dict[int, Dict[str, Dict[str, int]]]
        self.names = {}  # type: Dict[Any, str]
        self.kinds = {}  # type: Dict[type, Tuple[bool, bool]]

    def _kind(self, cls: type) -> Tuple[bool, bool]:
        """(DTensor-like, has untyped_storage) for a type."""
        kind = self.kinds.get(cls)
        if kind is None:
            kind = (
                callable(getattr(cls, "to_local", None)),
                callable(getattr(cls, "untyped_storage", None)),
            )
            self.kinds[cls] = kind
        return kind

    def count(self, objs: Iterable[Any], part: str, parts: Iterable[str]) -> None:
        """Count each tensor-like object of ``objs`` (its local shard when it
        is a DTensor-like wrapper) under ``part``; anything else is ignored.
        ``parts`` are the parts known, created empty on a device seen first.
        One loop with everything inlined: it runs once per tensor."""
        kinds = self.kinds
        seen = self.seen
        names = self.names
        devices = self.devices
        count_cpu = self.count_cpu
        for obj in objs:
            if obj is None:
                continue
            kind = kinds.get(type(obj)) or self._kind(type(obj))
            if kind[0]:  # DTensor-like
                obj = _local_shard(obj)
                if obj is None:
                    continue
                kind = kinds.get(type(obj)) or self._kind(type(obj))
                if kind[0]:
                    continue  # a shard of a shard: not something PyTorch makes
            device = getattr(obj, "device", None)
            dtype = getattr(obj, "dtype", None)
            if device is None or dtype is None:
                continue  # not tensor-like (a step count, a learning rate)
            device_type = getattr(device, "type", None)
            if device_type == "cuda":
                index = getattr(device, "index", None)
                if type(index) is not int or index < 0:
                    continue
            elif device_type == "cpu" and count_cpu:
                index = CPU_INDEX
            else:
                continue
            nbytes = None
            if kind[1]:
                try:
                    storage = obj.untyped_storage()
                    nbytes = storage.nbytes()
                    if nbytes > 0:
                        key = (index, storage.data_ptr())
                        if key in seen:
                            nbytes = 0
                        else:
                            seen.add(key)
                    else:
                        nbytes = 0  # freed or not gathered: resident nowhere
                except Exception:
                    nbytes = None  # no storage to look at (sparse, wrappers): by size
            if nbytes is None:
                nbytes = self._size_once(obj)
            device_parts = devices.get(index)
            if device_parts is None:
                device_parts = devices[index] = {name: {} for name in parts}
            if nbytes:
                try:
                    name = names.get(dtype)
                    if name is None:
                        name = names[dtype] = dtype_name(dtype)
                except TypeError:  # an unhashable dtype
                    name = dtype_name(dtype)
                by_dtype = device_parts[part]
                by_dtype[name] = by_dtype.get(name, 0) + nbytes

    def _size_once(self, tensor: Any) -> int:
        """``numel() * element_size()`` the first time an object is met."""
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
    """A DTensor's local shard: its ``_local_tensor`` when present, which
    needs no autograd, else ``to_local()``; None when that fails."""
    local = getattr(obj, "_local_tensor", None)
    if local is None:
        try:
            local = obj.to_local()
        except Exception:
            return None
    return local


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
        # DeepSpeed ZeRO-3: the resident partition, plus whatever is gathered
        # right now (an empty storage when not).
        counter.count([getattr(param, "ds_tensor", None) for param in params], PARAMS, parts)
        counter.count(params, PARAMS, parts)
        counter.count([getattr(param, "grad", None) for param in params], GRADS, parts)
    if optimizers is not None:
        for optimizer in optimizers:
            counter.count(_state_tensors(_state(optimizer)), OPTIMIZER, parts)
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
