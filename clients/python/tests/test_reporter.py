import json
import os
import socket
import time
import unittest
import warnings
from unittest import mock

from headroom_client import Reporter, _sender

from ._fake_agent import FakeAgent, TempSocketDir

DEVICE = {
    "index": 0,
    "uuid": "GPU-3b7e6e2c-0d7a-4f5c-9a53-0c2d5a1f8e11",
    "allocated_bytes": 1000,
    "reserved_bytes": 2048,
    "active_bytes": 1500,
    "inactive_split_bytes": 48,
    "peak_allocated_bytes": 1800,
    "alloc_retries": 2,
    "ooms": 1,
}


def one_device():
    return [dict(DEVICE)]


def large_report():
    """The largest report the wire format allows (~30 KB)."""
    device = dict(DEVICE, uuid="GPU-" + "f" * 92)
    for key in ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
                "peak_allocated_bytes", "alloc_retries", "ooms"):
        device[key] = (1 << 63) - 1
    return [dict(device, index=i) for i in range(64)]


def small_send_buffer(reporter):
    """Make the reporter's connections use a tiny send buffer, so that a large
    line is only partly written when the agent does not read."""
    sender = reporter._sender
    real = sender._new_socket

    def new_socket():
        sock = real()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return sock

    sender._new_socket = new_socket


class ReporterTestCase(unittest.TestCase):
    def setUp(self):
        self.dir = TempSocketDir()
        self.addCleanup(self.dir.cleanup)
        self.path = self.dir.socket_path()

    def agent(self, reading=True):
        agent = FakeAgent(self.path, reading=reading)
        self.addCleanup(agent.close)
        return agent

    def reporter(self, provider=one_device, **kwargs):
        kwargs.setdefault("reconnect_interval_s", 0.01)
        reporter = Reporter(self.path, stats_provider=provider, **kwargs)
        self.addCleanup(reporter.stop, 2.0)
        return reporter


class DeliveryTest(ReporterTestCase):
    def test_report_arrives_with_exact_fields_and_sender_pid(self):
        agent = self.agent()
        reporter = self.reporter()
        before_ms = int(time.time() * 1000)
        reporter.tick()
        after_ms = int(time.time() * 1000)

        _, peer, report = agent.next_line()
        self.assertEqual(list(report), ["v", "pid", "ts_ms", "devices"])
        self.assertEqual(report["v"], 1)
        self.assertEqual(report["pid"], os.getpid())
        if peer is not None:  # what the agent verifies with SO_PEERCRED
            self.assertEqual(peer, report["pid"])
        self.assertIsInstance(report["ts_ms"], int)
        self.assertTrue(before_ms <= report["ts_ms"] <= after_ms)
        self.assertEqual(report["devices"], [DEVICE])
        self.assertEqual(list(report["devices"][0]), list(DEVICE))
        self.assertEqual((reporter.sent, reporter.dropped, reporter.errors), (1, 0, 0))
        self.assertTrue(reporter.connected)

    def test_each_tick_sends_one_line_on_one_connection(self):
        agent = self.agent()
        counter = iter(range(100))
        reporter = self.reporter(lambda: [dict(DEVICE, allocated_bytes=next(counter))])
        for _ in range(5):
            reporter.tick()
        got = [agent.next_line() for _ in range(5)]
        self.assertEqual([r["devices"][0]["allocated_bytes"] for _, _, r in got], [0, 1, 2, 3, 4])
        self.assertEqual({number for number, _, _ in got}, {0})
        self.assertEqual(reporter.sent, 5)
        agent.assert_no_line(self)

    def test_empty_provider_sends_nothing_and_does_not_connect(self):
        agent = self.agent()
        devices = []
        reporter = self.reporter(lambda: list(devices))
        for _ in range(5):
            reporter.tick()
        agent.assert_no_line(self)
        self.assertEqual(agent.connections, [])
        self.assertFalse(reporter.connected)
        self.assertEqual((reporter.sent, reporter.dropped, reporter.errors), (0, 0, 0))

        devices.append(dict(DEVICE))
        reporter.tick()
        _, _, report = agent.next_line()
        self.assertEqual(report["devices"], [DEVICE])

    def test_more_than_64_devices_truncated(self):
        agent = self.agent()
        reporter = self.reporter(lambda: [dict(DEVICE, index=i) for i in range(100)])
        reporter.tick()
        number, pid, line = agent.lines.get(timeout=5)
        self.assertLessEqual(len(line) + 1, 32768)
        devices = json.loads(line)["devices"]
        self.assertEqual([d["index"] for d in devices], list(range(64)))

    def test_stop_closes_the_connection(self):
        agent = self.agent()
        reporter = self.reporter()
        reporter.tick()
        agent.next_line()
        reporter.stop()
        self.assertFalse(reporter.connected)
        self.assertTrue(agent.wait_for(lambda: agent.peer_closed(0)))


class NoAgentTest(ReporterTestCase):
    def test_ticks_without_agent_are_silent_drops(self):
        reporter = self.reporter(reconnect_interval_s=60)
        for _ in range(3):
            reporter.tick()
        self.assertEqual((reporter.sent, reporter.dropped, reporter.errors), (0, 3, 0))
        self.assertFalse(reporter.connected)

    def test_connection_attempts_are_rate_limited(self):
        reporter = self.reporter(reconnect_interval_s=60)
        sender = reporter._sender
        with mock.patch.object(sender, "_new_socket", wraps=sender._new_socket) as new_socket:
            for _ in range(50):
                reporter.tick()
        self.assertEqual(new_socket.call_count, 1)
        self.assertEqual(reporter.dropped, 50)

    def test_socket_path_that_is_not_a_socket(self):
        with open(self.path, "w"):
            pass
        reporter = self.reporter()
        reporter.tick()
        self.assertEqual((reporter.sent, reporter.dropped, reporter.errors), (0, 1, 0))

    def test_agent_appearing_later_receives_reports(self):
        reporter = self.reporter()
        reporter.tick()
        self.assertEqual(reporter.dropped, 1)
        agent = self.agent()
        time.sleep(0.02)  # past the reconnect interval
        reporter.tick()
        _, _, report = agent.next_line()
        self.assertEqual(report["devices"], [DEVICE])
        self.assertTrue(reporter.connected)


class BrokenAgentTest(ReporterTestCase):
    def test_agent_that_never_reads_never_blocks_ticks(self):
        agent = self.agent(reading=False)
        devices = large_report()
        reporter = self.reporter(lambda: devices, reconnect_interval_s=60)
        for _ in range(2000):
            reporter.tick()
        self.assertGreater(reporter.sent, 0)
        self.assertGreater(reporter.dropped, 0)
        self.assertEqual(reporter.errors, 0)
        self.assertLessEqual(reporter.sent + reporter.dropped, 2000)
        self.assertEqual(len(agent.connections), 1)

    def test_line_framing_survives_partial_writes(self):
        agent = self.agent(reading=False)
        source = {"devices": large_report()}
        reporter = self.reporter(lambda: source["devices"], reconnect_interval_s=60)
        small_send_buffer(reporter)
        reporter.tick()  # a line larger than the send buffer: only partly written
        self.assertTrue(reporter._sender.has_pending)
        for _ in range(3):
            reporter.tick()  # no room: the tail stays pending, new reports dropped
        self.assertEqual(reporter.dropped, 3)
        self.assertTrue(agent.wait_for(lambda: len(agent.connections) == 1))
        conn, _ = agent.connections[0]
        conn.settimeout(2.0)

        # The agent now reads slowly; every tick pushes a little more.
        data = b""
        deadline = time.monotonic() + 5
        while reporter.sent < 5 and time.monotonic() < deadline:
            data += conn.recv(1 << 20)
            reporter.tick()
        source["devices"] = []  # no new reports: let the last tail finish
        while reporter._sender.has_pending and time.monotonic() < deadline:
            data += conn.recv(1 << 20)
            reporter.tick()
        self.assertFalse(reporter._sender.has_pending)
        conn.settimeout(0.05)
        try:
            while True:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            pass

        self.assertGreaterEqual(reporter.sent, 5)
        self.assertTrue(data.endswith(b"\n"))
        lines = data[:-1].split(b"\n")
        self.assertEqual(len(lines), reporter.sent)
        for line in lines:  # every line whole: no interleaved fragments
            self.assertEqual(len(json.loads(line)["devices"]), 64)

    def test_stalled_partial_line_is_given_up_and_connection_renewed(self):
        agent = self.agent(reading=False)
        devices = large_report()
        reporter = self.reporter(lambda: devices, reconnect_interval_s=0.01)
        small_send_buffer(reporter)
        reporter.tick()
        self.assertTrue(reporter._sender.has_pending)
        for _ in range(9):  # nine more ticks: each new report dropped, tail kept
            reporter.tick()
        self.assertTrue(reporter.connected)
        self.assertEqual((reporter.sent, reporter.dropped), (0, 9))
        reporter.tick()  # tenth stalled flush: tail given up, connection closed
        self.assertFalse(reporter.connected)
        self.assertEqual((reporter.sent, reporter.dropped), (0, 11))
        time.sleep(0.02)
        reporter.tick()  # reconnects
        self.assertTrue(agent.wait_for(lambda: len(agent.connections) == 2))
        self.assertEqual(reporter.errors, 0)

    def test_agent_closing_the_connection(self):
        agent = self.agent()
        reporter = self.reporter(reconnect_interval_s=0.01)
        reporter.tick()
        agent.next_line()
        agent.drop_connections()
        self.assertTrue(agent.wait_for(lambda: agent.peer_closed(0)))
        dropped_before = reporter.dropped
        for _ in range(3):
            reporter.tick()  # EPIPE / ECONNRESET: dropped, never raised
        self.assertGreater(reporter.dropped, dropped_before)
        self.assertEqual(reporter.errors, 0)
        time.sleep(0.02)
        reporter.tick()
        number, _, report = agent.next_line()
        self.assertGreaterEqual(number, 1)  # a new connection
        self.assertEqual(report["devices"], [DEVICE])


class ProviderFailureTest(ReporterTestCase):
    def test_provider_exception_is_counted_not_raised(self):
        agent = self.agent()

        def broken():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        reporter = self.reporter(broken)
        reporter.tick()
        reporter.tick()
        self.assertEqual(reporter.errors, 2)
        self.assertEqual((reporter.sent, reporter.dropped), (0, 0))
        agent.assert_no_line(self)

    def test_garbage_from_provider_is_counted(self):
        reporter = self.reporter(lambda: "not a list")
        reporter.tick()
        self.assertEqual(reporter.errors, 1)

    def test_thread_survives_a_failing_provider(self):
        agent = self.agent()
        calls = []

        def flaky():
            calls.append(1)
            if len(calls) <= 3:
                raise ValueError("transient")
            return one_device()

        reporter = self.reporter(flaky, interval_s=0.01).start()
        _, _, report = agent.next_line()
        self.assertEqual(report["devices"], [DEVICE])
        self.assertEqual(reporter.errors, 3)
        self.assertTrue(reporter.running)


class ThreadTest(ReporterTestCase):
    def test_thread_is_a_named_daemon_and_stop_joins_it(self):
        agent = self.agent()
        reporter = self.reporter(interval_s=0.01).start()
        thread = reporter._thread
        self.assertEqual(thread.name, "headroom-allocator-reporter")
        self.assertTrue(thread.daemon)
        agent.next_line()
        agent.next_line()
        reporter.stop()
        self.assertFalse(thread.is_alive())
        self.assertFalse(reporter.running)
        self.assertFalse(reporter.connected)

    def test_stop_is_prompt_with_a_long_interval(self):
        reporter = self.reporter(interval_s=3600).start()
        reporter.stop(timeout=5)
        self.assertFalse(reporter.running)

    def test_stop_from_inside_the_provider(self):
        agent = self.agent()
        holder = []

        def stop_after_first_report():
            if holder[0].sent >= 1:
                holder[0].stop()
            return one_device()

        reporter = self.reporter(stop_after_first_report, interval_s=0.01)
        holder.append(reporter)
        thread = reporter.start()._thread
        thread.join(5)
        self.assertFalse(thread.is_alive())
        self.assertFalse(reporter.connected)
        self.assertEqual(agent.next_line()[0], 0)

    def test_restart_after_stop(self):
        agent = self.agent()
        reporter = self.reporter(interval_s=0.01).start()
        agent.next_line()
        reporter.stop()
        reporter.start()
        self.assertTrue(reporter.running)
        number, _, _ = agent.next_line()
        while number == 0:  # lines still queued from the first connection
            number, _, _ = agent.next_line()
        self.assertEqual(number, 1)

    def test_invalid_arguments_rejected(self):
        for bad in (0, -1, float("nan"), float("inf")):
            with self.assertRaises(ValueError):
                Reporter(self.path, interval_s=bad)
        with self.assertRaises(TypeError):
            Reporter(self.path, interval_s="soon")
        with self.assertRaises(TypeError):
            Reporter(self.path, stats_provider=[DEVICE])


class ForkTest(ReporterTestCase):
    def test_pid_change_reconnects_instead_of_sharing_the_connection(self):
        # The fallback when os.register_at_fork is unavailable.
        agent = self.agent()
        reporter = self.reporter()
        reporter.tick()
        agent.next_line()
        with mock.patch.object(_sender.os, "getpid", return_value=os.getpid() + 1):
            self.assertFalse(reporter.connected)
            reporter.tick()
        number, _, _ = agent.next_line()
        self.assertEqual(number, 1)

    @unittest.skipUnless(hasattr(os, "fork"), "needs os.fork")
    def test_forked_child_reports_on_its_own_connection(self):
        agent = self.agent()
        reporter = self.reporter()
        reporter.tick()
        self.assertEqual(agent.next_line()[0], 0)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:  # child: exit without running the parent's test machinery
            status = 1
            try:
                if not reporter.connected:
                    reporter.tick()
                    status = 0 if (reporter.connected and reporter.errors == 0) else 2
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.WEXITSTATUS(status), 0)

        number, peer, report = agent.next_line()
        self.assertEqual(number, 1)
        self.assertEqual(report["pid"], pid)
        if peer is not None:
            self.assertEqual(peer, pid)
        # The parent's connection is intact and still its own.
        self.assertTrue(reporter.connected)
        reporter.tick()
        number, _, report = agent.next_line()
        self.assertEqual((number, report["pid"]), (0, os.getpid()))
        agent.assert_no_line(self)


if __name__ == "__main__":
    unittest.main()
