"""A non-blocking, lossy line sender over a Unix stream socket.

Every method returns after at most one non-blocking system call per step; when
the agent is absent, slow or gone, lines are dropped rather than queued. At most
one partially written line is kept, so that line framing survives short writes.
"""

import errno
import os
import socket
import time
from typing import Any, Callable, Optional

# Seconds between connection attempts while the agent is unreachable.
DEFAULT_RECONNECT_INTERVAL_S = 5.0
# Consecutive ticks in which not one byte of a pending partial line could be
# written, after which the line is given up and the connection renewed.
STALL_LIMIT = 10

# Never let a write to a closed peer raise SIGPIPE, whatever the application did
# with the signal's disposition.
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)

LogOnce = Callable[..., None]  # (kind, message, *args)


def _error_kind(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code in errno.errorcode:
        return errno.errorcode[code]
    return type(exc).__name__


class LineSender:
    """Sends whole lines to a Unix socket; owns the connection and the
    ``sent``/``dropped`` counters. Not thread-safe: callers serialise access."""

    def __init__(self, path: Any, reconnect_interval_s: float, log_once: LogOnce) -> None:
        self._path = path
        self._reconnect_interval_s = reconnect_interval_s
        self._log_once = log_once
        self._sock = None  # type: Optional[socket.socket]
        self._sock_pid = None  # type: Optional[int]
        self._pending = None  # type: Optional[memoryview]
        self._stalled_flushes = 0
        self._next_connect_at = 0.0
        self.sent = 0
        self.dropped = 0

    @property
    def connected(self) -> bool:
        return self._sock is not None and self._sock_pid == os.getpid()

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    # -- connection ---------------------------------------------------------

    def _check_owner(self) -> None:
        """After fork() the child shares the parent's connection: writing on it
        would interleave bytes with the parent's lines. Drop it and reconnect."""
        if self._sock is not None and self._sock_pid != os.getpid():
            self.abandon_inherited()

    def abandon_inherited(self) -> None:
        """Forget a connection inherited across fork(), without touching the
        parent's stream: only this process's descriptor is closed (no shutdown),
        and the parent's half-written line is not ours to finish."""
        sock = self._sock
        self._sock = None
        self._sock_pid = None
        self._pending = None
        self._stalled_flushes = 0
        self._next_connect_at = 0.0
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _new_socket(self) -> socket.socket:
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def _connect(self) -> bool:
        now = time.monotonic()
        if now < self._next_connect_at:
            return False
        self._next_connect_at = now + self._reconnect_interval_s
        try:
            sock = self._new_socket()
        except (OSError, AttributeError) as exc:
            self._log_once(("socket", _error_kind(exc)), "cannot create a Unix socket: %s", exc)
            return False
        try:
            sock.setblocking(False)
            # A Unix-socket connect either completes at once or fails; EAGAIN
            # (listen backlog full) is treated like any other failure.
            sock.connect(self._path)
        except Exception as exc:
            sock.close()
            self._log_once(
                ("connect", _error_kind(exc)),
                "headroom agent not reachable at %s: %s (retrying every %ss, not logged again)",
                self._path,
                exc,
                self._reconnect_interval_s,
            )
            return False
        self._sock = sock
        self._sock_pid = os.getpid()
        self._stalled_flushes = 0
        return True

    def _drop_connection(self, exc: BaseException) -> None:
        """Close after a send error; the line in flight is lost."""
        self._log_once(("send", _error_kind(exc)), "lost connection to headroom agent: %s", exc)
        self.close()
        self.dropped += 1
        self._next_connect_at = time.monotonic() + self._reconnect_interval_s

    def close(self) -> None:
        """Close the connection; a pending partial line counts as dropped."""
        sock = self._sock
        self._sock = None
        self._sock_pid = None
        self._stalled_flushes = 0
        if self._pending is not None:
            self._pending = None
            self.dropped += 1
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    # -- sending ------------------------------------------------------------

    def flush(self) -> bool:
        """Try to finish the pending partial line. Returns True when the
        connection is free for a new line."""
        self._check_owner()
        pending = self._pending
        if pending is None:
            return True
        sock = self._sock
        if sock is None:  # cannot happen: a pending tail implies a connection
            self._pending = None
            return True
        try:
            written = sock.send(pending, _SEND_FLAGS)
        except BlockingIOError:
            written = 0
        except OSError as exc:
            self._pending = None
            self._drop_connection(exc)
            return True
        if written >= len(pending):
            self._pending = None
            self._stalled_flushes = 0
            self.sent += 1
            return True
        self._pending = pending[written:]
        # A reader that makes progress, however slowly, is not stuck.
        self._stalled_flushes = 0 if written > 0 else self._stalled_flushes + 1
        if self._stalled_flushes >= STALL_LIMIT:
            self._log_once(("send", "stalled"), "headroom agent is not reading; reconnecting")
            self.close()  # counts the pending line as dropped
            self._next_connect_at = time.monotonic() + self._reconnect_interval_s
            return True
        return False

    def drop(self) -> None:
        """Count a line that was not even attempted."""
        self.dropped += 1

    def send(self, line: bytes) -> None:
        """Write one whole line, or keep its unwritten tail, or drop it."""
        self._check_owner()
        if self._pending is not None:
            self.dropped += 1
            return
        if self._sock is None and not self._connect():
            self.dropped += 1
            return
        sock = self._sock
        if sock is None:
            self.dropped += 1
            return
        try:
            written = sock.send(line, _SEND_FLAGS)
        except BlockingIOError:
            self.dropped += 1  # socket buffer full, nothing written
            return
        except OSError as exc:
            self._drop_connection(exc)
            return
        if written >= len(line):
            self.sent += 1
        elif written <= 0:
            self.dropped += 1
        else:
            self._pending = memoryview(line)[written:]
            self._stalled_flushes = 0
