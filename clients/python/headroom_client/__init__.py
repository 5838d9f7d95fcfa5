"""Headroom allocator client: reports PyTorch's CUDA caching-allocator
statistics to the local Headroom agent.

One line in a training script::

    import headroom_client
    headroom_client.enable()

A daemon thread then sends ``torch.cuda.memory_stats()`` of every device the
process uses, once per second, over the agent's Unix socket. It never blocks or
raises into the job: when no agent listens, reports are silently dropped.

``headroom_client.enable(model=model, optimizer=optimizer)`` also counts, every
10 seconds, the bytes of the model's parameters, gradients and optimizer state
on each device, so that Headroom can say where the job's memory goes.
"""

import logging
import os
import threading
from typing import Any, Optional

from ._config import DEFAULT_SOCKET_PATH, DISABLE_ENV, SOCKET_ENV, disabled_by_env
from ._reporter import Reporter, StatsProvider
from ._torch_stats import torch_memory_stats

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "DISABLE_ENV",
    "SOCKET_ENV",
    "Reporter",
    "disable",
    "enable",
    "torch_memory_stats",
]
__version__ = "0.1.0"

logging.getLogger("headroom_client").addHandler(logging.NullHandler())

_global_lock = threading.Lock()
_global_reporter = None  # type: Optional[Reporter]


def enable(
    socket_path: Any = None,
    interval_s: float = 1.0,
    stats_provider: Optional[StatsProvider] = None,
    *,
    model: Any = None,
    optimizer: Any = None,
    composition_interval_s: float = 10.0,
) -> Reporter:
    """Start reporting in the background and return the process's Reporter.

    Idempotent: later calls return the same Reporter (restarted if it had been
    stopped) and ignore their arguments, except ``model`` and ``optimizer``:
    each one given replaces the one tracked before (see
    :meth:`Reporter.track`). When ``$HEADROOM_ALLOCATOR_DISABLE`` is
    ``1``/``true``/``yes`` the returned Reporter is inert and never started.

    ``model`` (a module or a list of modules) and ``optimizer`` (an optimizer
    or a list of them) are optional: with them, the reporter thread counts the
    bytes of their parameters, gradients and optimizer state on each device
    every ``composition_interval_s`` seconds, and each report carries the
    latest count. They are held by weak reference where possible.

    ``socket_path`` defaults to ``$HEADROOM_ALLOCATOR_SOCKET``, else
    ``/run/headroom/allocator.sock``. ``stats_provider`` is a zero-argument
    callable returning a list of device dicts; the default reads PyTorch.

    Never raises because of the environment (no torch, no agent, missing socket,
    permission denied); raises TypeError/ValueError only for invalid arguments.
    """
    global _global_reporter
    with _global_lock:
        reporter = _global_reporter
        if reporter is None:
            reporter = Reporter(
                socket_path,
                interval_s,
                stats_provider,
                enabled=not disabled_by_env(),
                model=model,
                optimizer=optimizer,
                composition_interval_s=composition_interval_s,
            )
            _global_reporter = reporter
        else:
            reporter.track(model, optimizer)
        return reporter.start()


def disable(timeout: Optional[float] = None) -> None:
    """Stop the Reporter started by :func:`enable`; a later ``enable()`` starts a new one."""
    global _global_reporter
    with _global_lock:
        reporter = _global_reporter
        _global_reporter = None
    if reporter is not None:
        reporter.stop(timeout)


def _forget_global_after_fork() -> None:
    # The child has no reporter thread; its enable() must start a fresh one.
    global _global_lock, _global_reporter
    _global_lock = threading.Lock()
    _global_reporter = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_global_after_fork)
