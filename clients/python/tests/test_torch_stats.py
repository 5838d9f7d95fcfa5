import os
import sys
import time
import types
import unittest
from unittest import mock

from headroom_client import Reporter, _torch_stats, torch_memory_stats

from ._fake_agent import FakeAgent, TempSocketDir


def stats(reserved, base=0):
    return {
        "allocated_bytes.all.current": base + 100,
        "reserved_bytes.all.current": reserved,
        "active_bytes.all.current": base + 120,
        "inactive_split_bytes.all.current": base + 30,
        "allocated_bytes.all.peak": base + 500,
        "num_alloc_retries": base + 2,
        "num_ooms": base + 1,
        "allocation.all.current": 7,  # unrelated keys are ignored
    }


class FakeProps:
    def __init__(self, uuid):
        if uuid is not None:
            self.uuid = uuid


class FakeUUID:
    """torch's _CUDAUUID prints as bare hex."""

    def __str__(self):
        return "3b7e6e2c-0d7a-4f5c-9a53-0c2d5a1f8e11"


class FakeCuda:
    def __init__(self, per_device, uuids=None, available=True, initialized=True):
        self.per_device = per_device
        self.uuids = uuids or {}
        self.available = available
        self.initialized = initialized
        self.calls = []

    def is_available(self):
        self.calls.append("is_available")
        return self.available

    def is_initialized(self):
        self.calls.append("is_initialized")
        return self.initialized

    def device_count(self):
        self.calls.append("device_count")
        return len(self.per_device)

    def memory_stats(self, index):
        self.calls.append(("memory_stats", index))
        value = self.per_device[index]
        if isinstance(value, Exception):
            raise value
        return value

    def get_device_properties(self, index):
        self.calls.append(("get_device_properties", index))
        uuid = self.uuids.get(index)
        if isinstance(uuid, Exception):
            raise uuid
        return FakeProps(uuid)


def fake_torch(cuda):
    module = types.ModuleType("torch")
    module.cuda = cuda
    return module


class TorchProviderTest(unittest.TestCase):
    def with_torch(self, module):
        patcher = mock.patch.dict(sys.modules, {"torch": module})
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_torch_not_importable(self):
        self.with_torch(None)  # makes "import torch" raise ImportError
        self.assertEqual(torch_memory_stats(), [])
        self.assertEqual(_torch_stats.read_devices(), [])

    def test_torch_never_imported_by_the_reporter(self):
        with mock.patch.dict(sys.modules):
            sys.modules.pop("torch", None)
            self.assertEqual(torch_memory_stats(), [])
            self.assertNotIn("torch", sys.modules)

    def test_maps_keys_and_skips_devices_without_reserved_memory(self):
        cuda = FakeCuda(
            [stats(2048), stats(0), stats(4096, base=1000), {}],
            uuids={0: "GPU-aaaa", 2: FakeUUID()},
        )
        self.with_torch(fake_torch(cuda))
        self.assertEqual(
            torch_memory_stats(),
            [
                {
                    "index": 0,
                    "uuid": "GPU-aaaa",
                    "allocated_bytes": 100,
                    "reserved_bytes": 2048,
                    "active_bytes": 120,
                    "inactive_split_bytes": 30,
                    "peak_allocated_bytes": 500,
                    "alloc_retries": 2,
                    "ooms": 1,
                },
                {
                    "index": 2,
                    "uuid": "3b7e6e2c-0d7a-4f5c-9a53-0c2d5a1f8e11",
                    "allocated_bytes": 1100,
                    "reserved_bytes": 4096,
                    "active_bytes": 1120,
                    "inactive_split_bytes": 1030,
                    "peak_allocated_bytes": 1500,
                    "alloc_retries": 1002,
                    "ooms": 1001,
                },
            ],
        )
        self.assertNotIn(("get_device_properties", 1), cuda.calls)

    def test_missing_keys_and_unknown_uuid(self):
        cuda = FakeCuda(
            [{"reserved_bytes.all.current": 10}, {"reserved_bytes.all.current": 20}],
            uuids={1: RuntimeError("no properties")},
        )
        self.with_torch(fake_torch(cuda))
        devices = torch_memory_stats()
        self.assertEqual([d["index"] for d in devices], [0, 1])
        for device in devices:
            self.assertNotIn("uuid", device)
            self.assertEqual(device["allocated_bytes"], 0)
            self.assertEqual(device["ooms"], 0)

    def test_cuda_not_initialized_touches_nothing(self):
        cuda = FakeCuda([stats(2048)], initialized=False)
        self.with_torch(fake_torch(cuda))
        self.assertEqual(torch_memory_stats(), [])
        self.assertEqual(cuda.calls, ["is_initialized"])

    def test_cuda_not_available(self):
        cuda = FakeCuda([stats(2048)], available=False)
        self.with_torch(fake_torch(cuda))
        self.assertEqual(torch_memory_stats(), [])
        self.assertNotIn("device_count", cuda.calls)

    def test_torch_still_importing(self):
        module = fake_torch(FakeCuda([stats(2048)]))
        module.__spec__ = types.SimpleNamespace(_initializing=True)
        self.with_torch(module)
        self.assertEqual(torch_memory_stats(), [])
        self.assertEqual(module.cuda.calls, [])

    def test_failure_returns_empty(self):
        cuda = FakeCuda([RuntimeError("CUDA error")])
        self.with_torch(fake_torch(cuda))
        self.assertEqual(torch_memory_stats(), [])
        with self.assertRaises(RuntimeError):
            _torch_stats.read_devices()


class DefaultProviderReporterTest(unittest.TestCase):
    def setUp(self):
        self.dir = TempSocketDir()
        self.addCleanup(self.dir.cleanup)
        self.agent = FakeAgent(self.dir.socket_path())
        self.addCleanup(self.agent.close)

    def reporter(self, torch_module):
        patcher = mock.patch.dict(sys.modules, {"torch": torch_module})
        patcher.start()
        self.addCleanup(patcher.stop)
        reporter = Reporter(self.agent.path, interval_s=0.01)
        self.addCleanup(reporter.stop, 2.0)
        return reporter

    def test_reports_torch_statistics(self):
        reporter = self.reporter(fake_torch(FakeCuda([stats(0), stats(2048)])))
        reporter.tick()
        _, _, report = self.agent.next_line()
        self.assertEqual(report["pid"], os.getpid())
        self.assertEqual([d["index"] for d in report["devices"]], [1])
        self.assertEqual(report["devices"][0]["reserved_bytes"], 2048)

    def test_without_torch_nothing_is_sent(self):
        reporter = self.reporter(None).start()
        time.sleep(0.05)  # a few ticks
        self.agent.assert_no_line(self)
        self.assertEqual(self.agent.connections, [])
        self.assertEqual((reporter.sent, reporter.dropped, reporter.errors), (0, 0, 0))
        self.assertTrue(reporter.running)

    def test_torch_failure_counts_an_error(self):
        reporter = self.reporter(fake_torch(FakeCuda([RuntimeError("CUDA error")])))
        reporter.tick()
        reporter.tick()
        self.assertEqual(reporter.errors, 2)
        self.agent.assert_no_line(self)


if __name__ == "__main__":
    unittest.main()
