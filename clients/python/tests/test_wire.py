import json
import unittest

from headroom_client import _wire

FULL_DEVICE = {
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


class EncodeReportTest(unittest.TestCase):
    def test_exact_line_format(self):
        line = _wire.encode_report([FULL_DEVICE], pid=4242, ts_ms=1700000000123)
        self.assertEqual(
            line,
            b'{"v":1,"pid":4242,"ts_ms":1700000000123,"devices":[{"index":0,'
            b'"uuid":"GPU-3b7e6e2c-0d7a-4f5c-9a53-0c2d5a1f8e11","allocated_bytes":1,'
            b'"reserved_bytes":2,"active_bytes":3,"inactive_split_bytes":4,'
            b'"peak_allocated_bytes":5,"alloc_retries":6,"ooms":7}]}\n',
        )

    def test_uuid_omitted_when_unknown_or_unusable(self):
        for uuid in (None, "", "   ", 12, "x" * 97, "GPU-\u00e9", "GPU-a b", "MIG-GPU-3b7e/1/0"):
            line = _wire.encode_report([{"index": 1, "uuid": uuid}], 1, 1)
            device = json.loads(line)["devices"][0]
            self.assertNotIn("uuid", device, uuid)
            self.assertEqual(device["index"], 1)

    def test_device_uuids_kept_verbatim(self):
        for uuid in ("3b7e6e2c-0d7a-4f5c-9a53-0c2d5a1f8e11", "MIG-3B7E6E2C-0D7A", "G" * 96):
            line = _wire.encode_report([{"index": 0, "uuid": uuid}], 1, 1)
            self.assertEqual(json.loads(line)["devices"][0]["uuid"], uuid)

    def test_counters_are_non_negative_ints(self):
        device = {
            "index": 2,
            "allocated_bytes": -5,
            "reserved_bytes": 3.9,
            "active_bytes": "12",
            "inactive_split_bytes": True,
            "peak_allocated_bytes": 1 << 70,
            "alloc_retries": float("nan"),
            # "ooms" missing
        }
        devices = json.loads(_wire.encode_report([device], 1, 1))["devices"]
        self.assertEqual(
            devices,
            [
                {
                    "index": 2,
                    "allocated_bytes": 0,
                    "reserved_bytes": 3,
                    "active_bytes": 12,
                    "inactive_split_bytes": 0,
                    "peak_allocated_bytes": (1 << 63) - 1,
                    "alloc_retries": 0,
                    "ooms": 0,
                }
            ],
        )

    def test_invalid_devices_skipped_and_empty_means_nothing(self):
        self.assertIsNone(_wire.encode_report([], 1, 1))
        self.assertIsNone(_wire.encode_report(None, 1, 1))
        self.assertIsNone(
            _wire.encode_report(
                ["gpu0", {"index": -1}, {"index": "0"}, {"index": True}, {"index": 1 << 32}, {}], 1, 1
            )
        )
        line = _wire.encode_report([{"uuid": "GPU-1"}, {"index": 3}], 1, 1)
        self.assertEqual([d["index"] for d in json.loads(line)["devices"]], [3])

    def test_non_list_result_is_an_error(self):
        for bad in ("devices", {"index": 0}, 5):
            with self.assertRaises(TypeError):
                _wire.encode_report(bad, 1, 1)

    def test_truncates_to_64_devices_and_bounds_line_size(self):
        huge = dict(FULL_DEVICE, uuid="G" * 96)
        for key in _wire.COUNTER_FIELDS:
            huge[key] = (1 << 63) - 1
        devices = [dict(huge, index=i) for i in range(200)]
        line = _wire.encode_report(devices, pid=(1 << 31) - 1, ts_ms=(1 << 53))
        self.assertLessEqual(len(line), 32768)
        self.assertTrue(line.endswith(b"\n"))
        self.assertEqual(line.count(b"\n"), 1)
        report = json.loads(line)
        self.assertEqual(len(report["devices"]), 64)
        self.assertEqual([d["index"] for d in report["devices"]], list(range(64)))


if __name__ == "__main__":
    unittest.main()
