"""The default stats provider: PyTorch's CUDA caching-allocator statistics.

This module never imports torch and never initialises CUDA. It only looks at a
``torch`` module the application has already imported, and only once the
application has initialised CUDA itself: calling into CUDA from the reporter
thread first would create a context on every GPU of the process.
"""

import sys
from typing import Any, Dict, List

# Wire field <- key in torch.cuda.memory_stats(i).
STAT_KEYS = (
    ("allocated_bytes", "allocated_bytes.all.current"),
    ("reserved_bytes", "reserved_bytes.all.current"),
    ("active_bytes", "active_bytes.all.current"),
    ("inactive_split_bytes", "inactive_split_bytes.all.current"),
    ("peak_allocated_bytes", "allocated_bytes.all.peak"),
    ("alloc_retries", "num_alloc_retries"),
    ("ooms", "num_ooms"),
)


def _imported_torch() -> Any:
    """The application's fully imported torch module, or None.

    ``sys.modules["torch"]`` is None when torch is blocked from importing, absent
    when nobody imported it (then CUDA cannot have been initialised through it),
    and marked as initialising while another thread is still importing it.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    spec = getattr(torch, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False) is True:
        return None
    return torch


def _uuid_of(cuda: Any, index: int) -> Any:
    try:
        uuid = getattr(cuda.get_device_properties(index), "uuid", None)
        if uuid is None:
            return None
        # torch's UUID object prints as bare hex; keep whatever form it has
        # ("GPU-"/"MIG-" prefixed or bare): the agent matches both.
        text = str(uuid).strip()
        return text or None
    except Exception:
        return None


def read_devices() -> List[Dict[str, Any]]:
    """Allocator statistics of every device this process has memory reserved on.

    Returns [] when torch is not imported, CUDA is unavailable or not yet
    initialised. Unexpected failures raise, so that the caller can count them.
    """
    torch = _imported_torch()
    if torch is None:
        return []
    cuda = getattr(torch, "cuda", None)
    if cuda is None:
        return []
    # is_initialized() first: it is a pure Python flag check, whereas
    # is_available() may query the driver.
    if not cuda.is_initialized():
        return []
    if not cuda.is_available():
        return []
    devices = []  # type: List[Dict[str, Any]]
    for index in range(int(cuda.device_count())):
        stats = cuda.memory_stats(index)
        if not stats.get("reserved_bytes.all.current"):
            continue  # this process holds no memory on that device
        device = {"index": index}  # type: Dict[str, Any]
        uuid = _uuid_of(cuda, index)
        if uuid is not None:
            device["uuid"] = uuid
        for field, key in STAT_KEYS:
            device[field] = int(stats.get(key) or 0)
        devices.append(device)
    return devices


def torch_memory_stats() -> List[Dict[str, Any]]:
    """Like :func:`read_devices`, but returns [] instead of raising."""
    try:
        return read_devices()
    except Exception:
        return []
