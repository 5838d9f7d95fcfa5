"""A stand-in for the Headroom agent: a real Unix socket server in a thread."""

import json
import os
import queue
import shutil
import socket
import struct
import tempfile
import threading
import time
import unittest
from unittest import mock

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pid(conn):
    """The connecting process's pid as the kernel reports it (Linux), else None."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    pid, _uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, option, _PEERCRED.size))
    return pid


class TempSocketDir:
    """A short temporary directory for socket paths (AF_UNIX paths are limited)."""

    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="hr-")

    def socket_path(self, name="agent.sock"):
        return os.path.join(self.path, name)

    def cleanup(self):
        shutil.rmtree(self.path, ignore_errors=True)


class FakeAgent:
    """Accepts connections on ``path``; when ``reading`` is true, reads every
    connection and queues ``(connection_number, peer_pid, line_bytes)`` for
    each complete line. When false, connections are accepted and never read."""

    def __init__(self, path, reading=True):
        self.path = path
        self.reading = reading
        self.lines = queue.Queue()
        self.connections = []  # (socket, peer pid), in accept order
        self._closed_conns = set()
        self._stop = threading.Event()
        self._threads = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(16)
        self._listener.settimeout(0.02)
        self._spawn(self._accept_loop)

    def _spawn(self, target, *args):
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept_loop(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            number = len(self.connections)
            self.connections.append((conn, peer_pid(conn)))
            if self.reading:
                self._spawn(self._read_loop, number, conn)

    def _read_loop(self, number, conn):
        conn.settimeout(0.02)
        pid = self.connections[number][1]
        buffer = b""
        while not self._stop.is_set():
            try:
                data = conn.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self.lines.put((number, pid, line))
        self._closed_conns.add(number)

    def next_line(self, timeout=5.0):
        """(connection number, peer pid, parsed JSON) of the next line."""
        number, pid, line = self.lines.get(timeout=timeout)
        return number, pid, json.loads(line.decode("utf-8"))

    def assert_no_line(self, test, wait=0.1):
        try:
            got = self.lines.get(timeout=wait)
        except queue.Empty:
            return
        test.fail("unexpected report: %r" % (got,))

    def wait_for(self, predicate, timeout=5.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.005)
        return predicate()

    def peer_closed(self, number):
        return number in self._closed_conns

    def drop_connections(self):
        """Close every accepted connection (the agent restarting its sessions)."""
        for conn, _ in self.connections:
            try:
                conn.close()
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(2.0)
        self.drop_connections()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class EnvTestCase(unittest.TestCase):
    """A test of the global ``enable()``: no reporter left from another test,
    the environment restored afterwards and cleared of the client's
    variables, and a fresh socket path in ``self.path``."""

    def setUp(self):
        import headroom_client

        headroom_client.disable()
        self.addCleanup(headroom_client.disable)
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        os.environ.pop("HEADROOM_ALLOCATOR_SOCKET", None)
        os.environ.pop("HEADROOM_ALLOCATOR_DISABLE", None)
        self.dir = TempSocketDir()
        self.addCleanup(self.dir.cleanup)
        self.path = self.dir.socket_path()
