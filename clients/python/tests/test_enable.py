import contextlib
import io
import logging
import os
import threading
import time
import unittest
import warnings
from unittest import mock

import headroom_client
from headroom_client import _sender

from ._fake_agent import EnvTestCase, FakeAgent

DEVICE = {
    "index": 0,
    "uuid": "GPU-3b7e6e2c-0d7a-4f5c-9a53-0c2d5a1f8e11",
    "allocated_bytes": 1,
    "reserved_bytes": 2,
    "active_bytes": 3,
    "inactive_split_bytes": 4,
    "peak_allocated_bytes": 5,
    "alloc_retries": 6,
    "ooms": 7,
}


def provider():
    return [dict(DEVICE)]


def reporter_threads():
    return [t for t in threading.enumerate() if t.name == "headroom-allocator-reporter"]


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


class EnableTest(EnvTestCase):
    def agent(self):
        agent = FakeAgent(self.path)
        self.addCleanup(agent.close)
        return agent

    def test_enable_is_idempotent_and_disable_joins_the_thread(self):
        agent = self.agent()
        first = headroom_client.enable(self.path, interval_s=0.01, stats_provider=provider)
        second = headroom_client.enable()
        self.assertIs(first, second)
        self.assertIsInstance(first, headroom_client.Reporter)
        self.assertTrue(first.running)
        threads = reporter_threads()
        self.assertEqual(len(threads), 1)
        self.assertTrue(threads[0].daemon)

        _, _, report = agent.next_line()
        self.assertEqual(report["pid"], os.getpid())
        self.assertEqual(report["devices"], [DEVICE])

        headroom_client.disable()
        self.assertFalse(first.running)
        self.assertFalse(threads[0].is_alive())
        self.assertEqual(reporter_threads(), [])
        # A later enable() starts afresh.
        third = headroom_client.enable(self.path, interval_s=0.01, stats_provider=provider)
        self.assertIsNot(third, first)
        self.assertTrue(third.running)

    def test_socket_path_from_environment(self):
        os.environ["HEADROOM_ALLOCATOR_SOCKET"] = self.path
        agent = self.agent()
        reporter = headroom_client.enable(interval_s=0.01, stats_provider=provider)
        self.assertEqual(reporter.socket_path, self.path)
        _, _, report = agent.next_line()
        self.assertEqual(report["devices"], [DEVICE])

    def test_default_socket_path(self):
        reporter = headroom_client.enable(interval_s=3600, stats_provider=lambda: [])
        self.assertEqual(reporter.socket_path, "/run/headroom/allocator.sock")

    def test_disabled_by_environment_starts_nothing(self):
        agent = self.agent()
        for value in ("1", "true", "YES"):
            os.environ["HEADROOM_ALLOCATOR_DISABLE"] = value
            reporter = headroom_client.enable(self.path, interval_s=0.01, stats_provider=provider)
            self.assertFalse(reporter.enabled)
            self.assertFalse(reporter.running)
            self.assertIs(headroom_client.enable(), reporter)
            self.assertEqual(reporter_threads(), [])
            reporter.tick()
            reporter.start()
            self.assertEqual(reporter_threads(), [])
            self.assertEqual((reporter.sent, reporter.dropped, reporter.errors), (0, 0, 0))
            headroom_client.disable()
        agent.assert_no_line(self)
        self.assertEqual(agent.connections, [])

    def test_other_disable_values_do_not_disable(self):
        os.environ["HEADROOM_ALLOCATOR_DISABLE"] = "0"
        reporter = headroom_client.enable(self.path, interval_s=3600, stats_provider=lambda: [])
        self.assertTrue(reporter.running)

    def test_no_agent_is_silent_then_agent_appears(self):
        with mock.patch.object(_sender, "DEFAULT_RECONNECT_INTERVAL_S", 0.01):
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr):
                reporter = headroom_client.enable(self.path, interval_s=0.01, stats_provider=provider)
                self.assertTrue(wait_until(lambda: reporter.dropped >= 3))
            self.assertEqual(stderr.getvalue(), "")
            self.assertEqual((reporter.sent, reporter.errors), (0, 0))
            self.assertFalse(reporter.connected)
            self.assertTrue(reporter.running)

            agent = self.agent()
            _, _, report = agent.next_line()
            self.assertEqual(report["devices"], [DEVICE])
            self.assertTrue(reporter.connected)
            self.assertGreaterEqual(reporter.sent, 1)

    def test_one_debug_line_per_failure_kind(self):
        reporter = headroom_client.Reporter(
            self.path, stats_provider=provider, reconnect_interval_s=0.001
        )
        with self.assertLogs("headroom_client", logging.DEBUG) as logs:
            for _ in range(20):
                reporter.tick()
                time.sleep(0.002)
        self.assertGreaterEqual(reporter.dropped, 20)
        self.assertEqual(len(logs.records), 1)
        self.assertIn(self.path, logs.records[0].getMessage())

    @unittest.skipUnless(hasattr(os, "fork"), "needs os.fork")
    def test_forked_child_starts_its_own_reporter(self):
        agent = self.agent()
        parent = headroom_client.enable(self.path, interval_s=0.01, stats_provider=provider)
        _, _, report = agent.next_line()
        self.assertEqual(report["pid"], os.getpid())

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:
            status = 1
            try:
                inherited_idle = not parent.running and not parent.connected
                child = headroom_client.enable(self.path, interval_s=0.01, stats_provider=provider)
                sent = wait_until(lambda: child.sent >= 1, timeout=5)
                status = 0 if (inherited_idle and child is not parent and sent) else 2
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.WEXITSTATUS(status), 0)
        while True:
            _, peer, report = agent.next_line()
            if report["pid"] == pid:
                break
            self.assertEqual(report["pid"], os.getpid())
        if peer is not None:
            self.assertEqual(peer, pid)
        self.assertTrue(parent.running)


if __name__ == "__main__":
    unittest.main()
