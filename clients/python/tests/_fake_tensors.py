"""Duck-typed stand-ins for what the composition counter reads from PyTorch:
devices, storages, tensors, DTensors, DeepSpeed partitions, modules and
optimizers. Nothing here imports torch."""

import itertools

_addresses = itertools.count(0x7F0000000000, 0x100000)


class DType:
    """Prints like a torch.dtype: ``torch.float32``."""

    def __init__(self, name, size):
        self.name = name
        self.size = size

    def __str__(self):
        return "torch." + self.name

    __repr__ = __str__


FLOAT32 = DType("float32", 4)
BFLOAT16 = DType("bfloat16", 2)
FLOAT16 = DType("float16", 2)
INT64 = DType("int64", 8)


class Device:
    def __init__(self, type, index=None):
        self.type = type
        self.index = index


def cuda(index=0):
    return Device("cuda", index)


CPU = Device("cpu")


class Storage:
    def __init__(self, nbytes, data_ptr=None):
        self._nbytes = nbytes
        self._data_ptr = next(_addresses) if data_ptr is None else data_ptr

    def nbytes(self):
        return self._nbytes

    def data_ptr(self):
        return self._data_ptr


class Tensor:
    """A tensor of ``numel`` elements of ``dtype`` on ``device``, owning a
    storage of its own unless ``storage`` (a shared one) is given."""

    def __init__(self, numel, dtype=FLOAT32, device=None, storage=None):
        self.device = cuda(0) if device is None else device
        self.dtype = dtype
        self._numel = numel
        self._storage = Storage(numel * dtype.size) if storage is None else storage
        self.grad = None

    def numel(self):
        return self._numel

    def element_size(self):
        return self.dtype.size

    def untyped_storage(self):
        return self._storage

    def values(self):  # torch.Tensor has values() (sparse); not a mapping
        raise RuntimeError("values is only for sparse tensors")


class Parameter(Tensor):
    pass


class PlainTensor:
    """Without untyped_storage(): counted by numel() * element_size()."""

    def __init__(self, numel, dtype=FLOAT32, device=None):
        self.device = cuda(0) if device is None else device
        self.dtype = dtype
        self._numel = numel

    def numel(self):
        return self._numel

    def element_size(self):
        return self.dtype.size


class StoragelessTensor(PlainTensor):
    """untyped_storage() raises, as for sparse tensors."""

    def untyped_storage(self):
        raise RuntimeError("Cannot access storage of SparseTensorImpl")


class DTensor:
    """A sharded tensor: global size ``numel``, this rank holds ``local``.
    Its own storage is empty, as a wrapper subclass's is."""

    def __init__(self, numel, local, with_local_attr=False):
        self.device = local.device
        self.dtype = local.dtype
        self._numel = numel
        self._local = local
        self.grad = None
        self.to_local_calls = 0
        if with_local_attr:
            self._local_tensor = local

    def to_local(self):
        self.to_local_calls += 1
        return self._local

    def numel(self):
        return self._numel

    def element_size(self):
        return self.dtype.size

    def untyped_storage(self):
        return Storage(0, data_ptr=0)


class ZeroParameter(Parameter):
    """A DeepSpeed ZeRO-3 parameter: ``ds_tensor`` is this rank's partition;
    the parameter's own storage is empty until gathered."""

    def __init__(self, numel, partition_numel, dtype=FLOAT32, device=None, gathered=False):
        storage = None if gathered else Storage(0, data_ptr=0)
        super().__init__(numel if gathered else 0, dtype, device, storage)
        self.ds_tensor = Tensor(partition_numel, dtype, self.device)


class Module:
    """Yields its parameters, then its children's, like nn.Module.parameters()
    (but without removing duplicates, to test that the counter does)."""

    def __init__(self, *params, children=()):
        self.params = list(params)
        self.children = list(children)
        self.parameters_calls = 0

    def parameters(self):
        self.parameters_calls += 1
        for param in self.params:
            yield param
        for child in self.children:
            yield from child.parameters()


class Optimizer:
    """state maps each parameter to a dict of name -> value, like torch.optim."""

    def __init__(self, params=()):
        self.param_groups = [{"params": list(params)}]
        self.state = {}

    def adam_step(self):
        """Adam's state: two tensors like each parameter, a CPU step count."""
        for param in self.param_groups[0]["params"]:
            if param not in self.state:
                self.state[param] = {
                    "step": Tensor(1, FLOAT32, CPU),
                    "exp_avg": Tensor(param.numel(), param.dtype, param.device),
                    "exp_avg_sq": Tensor(param.numel(), param.dtype, param.device),
                }


class OptimizerWrapper:
    """Like DeepSpeed's or accelerate's wrappers: no state, an .optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


class Unreferenceable:
    """A module that cannot be weakly referenced."""

    __slots__ = ("params",)

    def __init__(self, *params):
        self.params = list(params)

    def parameters(self):
        return iter(self.params)


def adam_model(n, numel=256, device=None, dtype=FLOAT32):
    """A model of ``n`` parameters with gradients and an Adam-like optimizer
    that has taken one step."""
    params = [Parameter(numel, dtype, device) for _ in range(n)]
    for param in params:
        param.grad = Tensor(numel, dtype, param.device)
    model = Module(*params)
    optimizer = Optimizer(params)
    optimizer.adam_step()
    return model, optimizer
