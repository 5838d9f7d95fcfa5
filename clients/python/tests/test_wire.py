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


class CompositionWireTest(unittest.TestCase):
    COMPOSITION = {
        "params": {"float32": 123, "bfloat16": 456},
        "grads": {"float32": 123},
        "optimizer": {"float32": 246},
    }

    def test_exact_v2_line(self):
        line = _wire.encode_report(
            [FULL_DEVICE, dict(FULL_DEVICE, index=1, uuid=None)], pid=4242, ts_ms=1700000000123,
            compositions={0: self.COMPOSITION},
        )
        self.assertEqual(
            line,
            b'{"v":2,"pid":4242,"ts_ms":1700000000123,"devices":[{"index":0,'
            b'"uuid":"GPU-3b7e6e2c-0d7a-4f5c-9a53-0c2d5a1f8e11","allocated_bytes":1,'
            b'"reserved_bytes":2,"active_bytes":3,"inactive_split_bytes":4,'
            b'"peak_allocated_bytes":5,"alloc_retries":6,"ooms":7,'
            b'"composition":{"params":{"bfloat16":456,"float32":123},"grads":{"float32":123},'
            b'"optimizer":{"float32":246}}},'
            b'{"index":1,"allocated_bytes":1,"reserved_bytes":2,"active_bytes":3,'
            b'"inactive_split_bytes":4,"peak_allocated_bytes":5,"alloc_retries":6,"ooms":7}]}\n',
        )

    def test_v1_unchanged_without_a_composition(self):
        v1 = _wire.encode_report([FULL_DEVICE], 4242, 1700000000123)
        for compositions in (None, {}, {5: self.COMPOSITION}, {0: {}}, {0: None},
                             {0: {"activations": {"float32": 1}}}, {0: "params"}):
            self.assertEqual(
                _wire.encode_report([FULL_DEVICE], 4242, 1700000000123, compositions), v1,
                compositions,
            )

    def test_a_composition_without_allocator_stats_is_not_sent(self):
        self.assertIsNone(_wire.encode_report([], 1, 1, {0: self.COMPOSITION}))
        line = _wire.encode_report([{"index": 1}], 1, 1, {0: self.COMPOSITION})
        report = json.loads(line)
        self.assertEqual(report["v"], 1)
        self.assertNotIn("composition", report["devices"][0])

    def test_unknown_parts_left_out_and_empty_parts_kept(self):
        line = _wire.encode_report([FULL_DEVICE], 1, 1, {0: {"params": {"float32": 8}, "grads": {},
                                                             "optimizer": None}})
        report = json.loads(line)
        self.assertEqual(report["v"], 2)
        self.assertEqual(report["devices"][0]["composition"], {"params": {"float32": 8}, "grads": {}})

    def test_dtype_names_and_values_are_sanitised(self):
        part = {
            "float32": 10,
            "Float32": 1,        # upper case
            "torch.int8": 2,     # a dot
            "x" * 33: 3,         # too long
            "": 4,
            7: 5,                # not a string
            "float16": -6,       # negative: left out
            "bfloat16": 0,       # zero: left out
            "int64": 1 << 70,    # clamped
            "uint8": 2.9,
            "bool": "x",         # not a number: 0, left out
        }
        self.assertEqual(
            _wire.sanitize_part(part),
            {"int64": (1 << 63) - 1, "float32": 10, "uint8": 2, "other": 15},
        )
        self.assertEqual(list(_wire.sanitize_part(part)), ["int64", "float32", "uint8", "other"])
        self.assertIsNone(_wire.sanitize_part([("float32", 1)]))
        self.assertEqual(_wire.sanitize_part({"other": (1 << 63) - 1, "a": 5, "b": 5}),
                         {"a": 5, "b": 5, "other": (1 << 63) - 1})

    def test_at_most_eight_dtypes_the_smallest_merged_into_other(self):
        part = {"d%d" % i: 100 + i for i in range(10)}
        clean = _wire.sanitize_part(part)
        self.assertEqual(len(clean), 8)
        self.assertEqual(list(clean), ["d9", "d8", "d7", "d6", "d5", "d4", "d3", "other"])
        self.assertEqual(clean["other"], 100 + 101 + 102)
        self.assertEqual(sum(clean.values()), sum(part.values()))
        # Exactly eight names fit; an "other" of its own takes one place.
        self.assertEqual(len(_wire.sanitize_part({"d%d" % i: 1 for i in range(8)})), 8)
        with_other = dict({"d%d" % i: 10 for i in range(8)}, other=1)
        clean = _wire.sanitize_part(with_other)
        self.assertEqual(len(clean), 8)
        self.assertEqual(clean["other"], 11)

    def test_a_composition_is_put_in_wire_form_once(self):
        clean = _wire.sanitize_compositions({0: self.COMPOSITION, 1: None, 2: {"grads": {}}})
        self.assertEqual(list(clean), [0, 2])
        self.assertIsInstance(clean[0], _wire.WireComposition)
        self.assertIs(_wire.sanitize_composition(clean[0]), clean[0])  # not checked again
        self.assertEqual(
            _wire.encode_report([FULL_DEVICE], 1, 1, clean),
            _wire.encode_report([FULL_DEVICE], 1, 1, {0: self.COMPOSITION}),
        )

    def test_a_v2_line_may_exceed_the_v1_limit(self):
        devices = [dict(FULL_DEVICE, index=i) for i in range(64)]
        composition = {part: {"d%d" % i: (1 << 62) + i for i in range(4)}
                       for part in ("params", "grads", "optimizer")}
        line = _wire.encode_report(devices, 1, 1, {i: composition for i in range(64)})
        self.assertGreater(len(line), _wire.MAX_LINE_BYTES)
        self.assertLessEqual(len(line), _wire.MAX_COMPOSITION_LINE_BYTES)
        report = json.loads(line)
        self.assertEqual(report["v"], 2)
        self.assertTrue(all("composition" in d for d in report["devices"]))

    def test_too_long_v2_line_drops_the_compositions_first(self):
        huge = dict(FULL_DEVICE, uuid="G" * 96)
        for key in _wire.COUNTER_FIELDS:
            huge[key] = (1 << 63) - 1
        devices = [dict(huge, index=i) for i in range(64)]
        composition = {part: {("d%d" % i) * 5: (1 << 63) - 1 for i in range(8)}
                       for part in ("params", "grads", "optimizer")}
        line = _wire.encode_report(devices, 1, 1, {i: composition for i in range(64)})
        self.assertLessEqual(len(line), _wire.MAX_LINE_BYTES)
        report = json.loads(line)
        self.assertEqual(report["v"], 1)
        self.assertEqual(len(report["devices"]), 64)
        self.assertFalse(any("composition" in d for d in report["devices"]))
        self.assertEqual(line, _wire.encode_report(devices, 1, 1))


if __name__ == "__main__":
    unittest.main()
