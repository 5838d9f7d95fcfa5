"""The Reporter: a daemon thread that collects allocator statistics and sends
them to the agent once per interval."""

import atexit
import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, Optional, Set, Tuple

from . import _composition, _config, _sender, _torch_stats, _wire

THREAD_NAME = "headroom-allocator-reporter"

# The most of the reporter thread's time that counting a model may take: a
# count that took longer than this share of the interval stretches the wait
# before the next one (a model of millions of tensors is counted less often).
MAX_COMPOSITION_SHARE = 0.01

logger = logging.getLogger("headroom_client")

StatsProvider = Callable[[], Iterable[Any]]

# Every Reporter ever built, so that fork and interpreter exit can reach them.
_live_reporters = weakref.WeakSet()  # type: weakref.WeakSet[Reporter]


class Reporter:
    """Sends the process's allocator statistics to the Headroom agent.

    Use :func:`headroom_client.enable` rather than building one directly.
    ``tick()`` does one collection and one non-blocking send and never raises;
    ``start()`` runs it every ``interval_s`` seconds in a daemon thread.

    With a ``model`` and/or an ``optimizer`` (see :meth:`track`), a tick also
    counts, at most every ``composition_interval_s`` seconds, the bytes of
    their parameters, gradients and optimizer state on each device, and every
    report carries the latest count on the matching device.
    """

    def __init__(
        self,
        socket_path: Any = None,
        interval_s: float = 1.0,
        stats_provider: Optional[StatsProvider] = None,
        *,
        reconnect_interval_s: Optional[float] = None,
        enabled: bool = True,
        model: Any = None,
        optimizer: Any = None,
        composition_interval_s: float = 10.0,
    ) -> None:
        if socket_path is None:
            socket_path = _config.socket_path_from_env()
        self._socket_path = os.fspath(socket_path)
        self._interval_s = _positive_seconds("interval_s", interval_s)
        if reconnect_interval_s is None:
            reconnect_interval_s = _sender.DEFAULT_RECONNECT_INTERVAL_S
        reconnect_interval_s = _positive_seconds("reconnect_interval_s", reconnect_interval_s)
        if stats_provider is None:
            stats_provider = _torch_stats.read_devices
        elif not callable(stats_provider):
            raise TypeError("stats_provider must be a zero-argument callable")
        self._provider = stats_provider
        self._composition_interval_s = _positive_seconds(
            "composition_interval_s", composition_interval_s
        )
        # What track() was given, held weakly where possible; None: not tracked.
        self._models = None  # type: Optional[Tuple[_composition.Ref, ...]]
        self._optimizers = None  # type: Optional[Tuple[_composition.Ref, ...]]
        # The latest count in wire form, attached to every report; recounted when due.
        self._composition = None  # type: Optional[Dict[int, _wire.WireComposition]]
        self._next_composition_at = 0.0
        self._tracking_changed = False  # set by track(): count at the next tick
        self._clock = time.monotonic  # replaced by tests
        self.track(model, optimizer)
        self._enabled = bool(enabled)
        self._logged = set()  # type: Set[Tuple[str, str]]
        self._sender = _sender.LineSender(self._socket_path, reconnect_interval_s, self._log_once)
        self._errors = 0
        self._init_thread_state()
        _live_reporters.add(self)

    def _init_thread_state(self) -> None:
        self._tick_lock = threading.Lock()  # serialises tick() and the socket
        self._state_lock = threading.RLock()  # serialises start() and stop()
        self._stop_event = threading.Event()
        self._thread = None  # type: Optional[threading.Thread]

    # -- read-only state ----------------------------------------------------

    @property
    def sent(self) -> int:
        """Reports written completely to the agent socket."""
        return self._sender.sent

    @property
    def dropped(self) -> int:
        """Reports discarded: agent unreachable, socket full, or connection lost."""
        return self._sender.dropped

    @property
    def errors(self) -> int:
        """Collections that failed (the stats provider raised or returned garbage)."""
        return self._errors

    @property
    def connected(self) -> bool:
        """Whether this process currently holds a connection to the agent."""
        return self._sender.connected

    @property
    def running(self) -> bool:
        """Whether the reporter thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def enabled(self) -> bool:
        """False for the inert reporter returned when disabled by the environment."""
        return self._enabled

    @property
    def socket_path(self) -> str:
        return self._socket_path

    @property
    def interval_s(self) -> float:
        return self._interval_s

    @property
    def composition_interval_s(self) -> float:
        return self._composition_interval_s

    def __repr__(self) -> str:
        return "<Reporter %s running=%s connected=%s sent=%d dropped=%d errors=%d>" % (
            self._socket_path,
            self.running,
            self.connected,
            self.sent,
            self.dropped,
            self.errors,
        )

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> "Reporter":
        """Start the daemon thread (no-op when already running or disabled)."""
        if not self._enabled:
            return self
        with self._state_lock:
            if self.running:
                return self
            stop_event = threading.Event()
            thread = threading.Thread(
                target=self._run, args=(stop_event,), name=THREAD_NAME, daemon=True
            )
            try:
                thread.start()
            except RuntimeError as exc:  # "can't start new thread": resource limits
                self._log_once(("thread", type(exc).__name__), "cannot start reporter thread: %s", exc)
                return self
            self._stop_event = stop_event
            self._thread = thread
        return self

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop the thread, wait up to ``timeout`` seconds for it, close the socket."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._state_lock:
            thread = self._thread
            self._stop_event.set()
            if thread is threading.current_thread():
                return  # called from a tick: the thread closes the socket as it exits
            if thread is not None:
                thread.join(timeout)
            if thread is None or not thread.is_alive():
                self._thread = None
        # If the thread is still mid-tick it closes the socket itself on exit.
        if deadline is None:
            self._close_connection(-1)
        else:
            self._close_connection(max(0.0, deadline - time.monotonic()))

    def _close_connection(self, timeout: float) -> None:
        if self._tick_lock.acquire(timeout=timeout):
            try:
                self._sender.close()
            finally:
                self._tick_lock.release()

    def _run(self, stop_event: threading.Event) -> None:
        try:
            while not stop_event.is_set():
                self.tick()
                stop_event.wait(self._interval_s)
        finally:
            self._close_connection(-1)

    # -- what is counted -----------------------------------------------------

    def track(self, model: Any = None, optimizer: Any = None) -> "Reporter":
        """Count the memory of ``model`` (a module, or a list of modules) and
        of ``optimizer`` (an optimizer, or a list of optimizers) from now on.

        Each one given replaces what was tracked before; None leaves it as it
        was, and an empty list stops tracking it. They are held by weak
        reference where possible: once garbage collected they are no longer
        counted. Nothing is read here: the reporter thread counts them at its
        next tick. Raises TypeError for an object that is neither.
        """
        models = optimizers = None
        if model is not None:
            models = _composition.hold(model, "model")
        if optimizer is not None:
            optimizers = _composition.hold(optimizer, "optimizer")
        if model is not None:
            self._models = models
        if optimizer is not None:
            self._optimizers = optimizers
        if model is not None or optimizer is not None:
            self._tracking_changed = True  # count the new ones at the next tick
        return self

    def _current_composition(self) -> Optional[Dict[int, _wire.WireComposition]]:
        """The cached count, recounted first when ``composition_interval_s``
        has passed since the last count. Runs in tick(), never raises."""
        if self._models is None and self._optimizers is None:
            self._composition = None
            return None
        now = self._clock()
        if now < self._next_composition_at and not self._tracking_changed:
            return self._composition
        # Cleared before the references are read, so that a track() call made
        # during the count is counted at the next tick.
        self._tracking_changed = False
        self._next_composition_at = now + self._composition_interval_s
        models = _composition.alive(self._models)
        optimizers = _composition.alive(self._optimizers)
        if models is None and optimizers is None:
            self._composition = None  # all garbage collected
            return None
        try:
            # In wire form once here rather than at each report.
            self._composition = _wire.sanitize_compositions(
                _composition.read_with_retry(models, optimizers)
            )
            took = self._clock() - now
            if took > self._composition_interval_s * MAX_COMPOSITION_SHARE:
                self._next_composition_at = now + took / MAX_COMPOSITION_SHARE
        except Exception as exc:
            # Unknown is better than wrong: no composition until the next count.
            self._composition = None
            self._errors += 1
            self._log_once(("composition", type(exc).__name__), "counting the model's memory failed: %r", exc)
        return self._composition

    # -- work ---------------------------------------------------------------

    def tick(self) -> None:
        """Collect once and send once, without blocking; never raises."""
        if not self._enabled:
            return
        # Another tick in progress (thread vs. a direct call): skip, never wait.
        if not self._tick_lock.acquire(blocking=False):
            return
        try:
            self._tick()
        except Exception as exc:
            self._errors += 1
            self._log_once(("tick", type(exc).__name__), "reporter tick failed: %r", exc)
        finally:
            self._tick_lock.release()

    def _tick(self) -> None:
        sender = self._sender
        free = sender.flush()  # finish a half-written line before anything new
        try:
            devices = self._provider()
            # Nothing to report (no CUDA yet): no count either.
            compositions = self._current_composition() if devices else None
            line = _wire.encode_report(devices, os.getpid(), int(time.time() * 1000), compositions)
        except Exception as exc:
            self._errors += 1
            self._log_once(("provider", type(exc).__name__), "stats provider failed: %r", exc)
            return
        if line is None:
            return  # nothing to report: no connection attempt, nothing sent
        if free:
            sender.send(line)
        else:
            sender.drop()

    def _log_once(self, kind: Tuple[str, str], message: str, *args: Any) -> None:
        """One debug line per failure kind for the reporter's lifetime."""
        if kind in self._logged:
            return
        self._logged.add(kind)
        logger.debug(message, *args)

    # -- process events -----------------------------------------------------

    def _reset_after_fork(self) -> None:
        """In a fork child: no thread survived, locks may be held by threads that
        no longer exist, and the connection belongs to the parent."""
        self._init_thread_state()
        self._sender.abandon_inherited()


def _positive_seconds(name: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise TypeError("%s must be a number of seconds, not %r" % (name, value)) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError("%s must be a positive number of seconds, not %r" % (name, value))
    return seconds


def _after_fork_in_child() -> None:
    for reporter in list(_live_reporters):
        reporter._reset_after_fork()


def _stop_all_at_exit() -> None:
    # Stop threads before interpreter teardown so that no tick runs against
    # half-finalised modules (torch included).
    for reporter in list(_live_reporters):
        if reporter.running:
            reporter.stop(timeout=1.0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_stop_all_at_exit)
