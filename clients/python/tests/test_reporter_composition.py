import gc
import json
import logging
import os
import threading
import unittest

import headroom_client
from headroom_client import Reporter

from ._fake_agent import EnvTestCase, FakeAgent, TempSocketDir
from ._fake_tensors import BFLOAT16, Module, Optimizer, Parameter, Tensor, adam_model, cuda

GIB = 1 << 30


def device(index):
    return {
        "index": index,
        "allocated_bytes": 30 * GIB,
        "reserved_bytes": 50 * GIB,
        "active_bytes": 31 * GIB,
        "inactive_split_bytes": 3 * GIB,
        "peak_allocated_bytes": 40 * GIB,
        "alloc_retries": 0,
        "ooms": 0,
    }


def two_devices():
    return [device(0), device(1)]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class CountingModule(Module):
    """Records the threads its parameters are read from."""

    def __init__(self, *params):
        super().__init__(*params)
        self.threads = []

    def parameters(self):
        self.threads.append(threading.current_thread().name)
        return super().parameters()


class CompositionReporterTest(unittest.TestCase):
    def setUp(self):
        self.dir = TempSocketDir()
        self.addCleanup(self.dir.cleanup)
        self.path = self.dir.socket_path()
        self.agent = FakeAgent(self.path)
        self.addCleanup(self.agent.close)
        self.clock = Clock()

    def reporter(self, provider=two_devices, **kwargs):
        kwargs.setdefault("reconnect_interval_s", 0.01)
        reporter = Reporter(self.path, stats_provider=provider, **kwargs)
        reporter._clock = self.clock
        self.addCleanup(reporter.stop, 2.0)
        return reporter

    def report(self, reporter):
        reporter.tick()
        _, _, report = self.agent.next_line()
        return report

    def test_cached_composition_rides_on_the_matching_device(self):
        model, optimizer = adam_model(2, numel=100, device=cuda(1))
        reporter = self.reporter(model=model, optimizer=optimizer)
        report = self.report(reporter)
        self.assertEqual(report["v"], 2)
        first, second = report["devices"]
        self.assertNotIn("composition", first)
        self.assertEqual(
            second["composition"],
            {"params": {"float32": 800}, "grads": {"float32": 800}, "optimizer": {"float32": 1600}},
        )
        self.assertEqual(second["allocated_bytes"], 30 * GIB)
        self.assertEqual(reporter.errors, 0)

    def test_recounted_only_every_composition_interval(self):
        param = Parameter(100)
        model = CountingModule(param)
        optimizer = Optimizer([param])
        reporter = self.reporter(model=model, optimizer=optimizer, composition_interval_s=10.0)
        self.assertEqual(self.report(reporter)["devices"][0]["composition"]["optimizer"], {})
        # The optimizer gains state and gradients appear; the cached count
        # is sent until the interval has passed.
        optimizer.adam_step()
        param.grad = Tensor(100)
        for step in (1.0, 5.0, 9.9):
            self.clock.now = 1000.0 + step
            composition = self.report(reporter)["devices"][0]["composition"]
            self.assertEqual(composition["optimizer"], {})
            self.assertEqual(composition["grads"], {})
        self.assertEqual(len(model.threads), 1)
        self.clock.now = 1010.0
        composition = self.report(reporter)["devices"][0]["composition"]
        self.assertEqual(composition["optimizer"], {"float32": 800})
        self.assertEqual(composition["grads"], {"float32": 400})
        self.assertEqual(len(model.threads), 2)

    def test_many_dtypes_are_capped_on_the_wire(self):
        from ._fake_tensors import DType

        params = [Parameter(10 * (i + 1), DType("float%d" % i, 1)) for i in range(10)]
        params.append(Parameter(1000, DType("Not A Name", 1)))
        model = Module(*params)
        composition = self.report(self.reporter(model=model))["devices"][0]["composition"]
        self.assertEqual(len(composition["params"]), 8)
        self.assertEqual(composition["params"]["other"], 1000 + 10 + 20 + 30)
        self.assertEqual(sum(composition["params"].values()), 1000 + 10 * 55)

    def test_a_slow_count_stretches_the_interval(self):
        clock = self.clock

        class Slow(CountingModule):
            def parameters(self):
                clock.now += 0.5  # half a second to walk this model
                return super().parameters()

        model = Slow(Parameter(1))
        reporter = self.reporter(model=model, composition_interval_s=10.0)
        self.report(reporter)
        # 0.5 s is 5 % of 10 s; at most 1 % is spent counting: next in 50 s.
        for now in (1010.5, 1049.0):
            clock.now = now
            self.report(reporter)
            self.assertEqual(len(model.threads), 1)
        clock.now = 1050.0
        self.report(reporter)
        self.assertEqual(len(model.threads), 2)

    def test_nothing_to_report_counts_nothing(self):
        devices = []
        model = CountingModule(Parameter(1))
        reporter = self.reporter(lambda: list(devices), model=model)
        reporter.tick()
        self.assertEqual(model.threads, [])
        devices.append(device(0))
        self.assertEqual(self.report(reporter)["v"], 2)
        self.assertEqual(len(model.threads), 1)

    def test_plain_reporter_sends_v1(self):
        reporter = self.reporter()
        report = self.report(reporter)
        self.assertEqual(report["v"], 1)
        self.assertFalse(any("composition" in d for d in report["devices"]))

    def test_track_replaces_and_none_keeps(self):
        model, optimizer = adam_model(1, numel=10)
        reporter = self.reporter(model=model, optimizer=optimizer)
        self.report(reporter)
        # A new optimizer (e.g. a second training phase), model unchanged.
        _, bigger = adam_model(1, numel=1000)
        self.assertIs(reporter.track(optimizer=bigger), reporter)
        composition = self.report(reporter)["devices"][0]["composition"]  # counted at once
        self.assertEqual(composition["optimizer"], {"float32": 8000})
        self.assertEqual(composition["params"], {"float32": 40})
        # An empty list stops tracking that part.
        reporter.track(model=[])
        self.assertEqual(self.report(reporter)["devices"][0]["composition"],
                         {"optimizer": {"float32": 8000}})
        reporter.track(optimizer=())
        self.assertEqual(self.report(reporter)["v"], 1)

    def test_collected_model_means_no_composition(self):
        model, _ = adam_model(1, numel=10)
        reporter = self.reporter(model=model, composition_interval_s=1.0)
        self.assertEqual(self.report(reporter)["v"], 2)
        del model
        gc.collect()
        self.clock.now += 1.0
        report = self.report(reporter)
        self.assertEqual(report["v"], 1)
        self.assertEqual(reporter.errors, 0)

    def test_a_failing_count_is_an_error_and_the_report_still_goes(self):
        class Broken(Module):
            def parameters(self):
                raise RuntimeError("dictionary changed size during iteration")

        model = Broken()  # held weakly by the reporter: kept alive here
        reporter = self.reporter(model=model, composition_interval_s=1.0)
        with self.assertLogs("headroom_client", logging.DEBUG) as logs:
            for _ in range(3):
                report = self.report(reporter)
                self.assertEqual(report["v"], 1)
                self.clock.now += 1.0
        self.assertEqual(reporter.errors, 3)
        self.assertEqual(len(logs.records), 1)
        self.assertIn("RuntimeError", logs.records[0].getMessage())
        self.assertEqual(reporter.sent, 3)

    def test_a_failure_forgets_the_previous_count(self):
        param = Parameter(10)
        broken = []

        class Flaky(Module):
            def parameters(self):
                if broken:
                    raise ValueError("odd module")
                return super().parameters()

        model = Flaky(param)
        reporter = self.reporter(model=model, composition_interval_s=1.0)
        self.assertEqual(self.report(reporter)["v"], 2)
        broken.append(1)
        self.clock.now += 1.0
        self.assertEqual(self.report(reporter)["v"], 1)
        broken.clear()
        self.clock.now += 1.0
        self.assertEqual(self.report(reporter)["v"], 2)
        self.assertEqual(reporter.errors, 1)

    def test_invalid_arguments_rejected(self):
        with self.assertRaises(TypeError):
            Reporter(self.path, model=object())
        with self.assertRaises(TypeError):
            Reporter(self.path, optimizer=[Optimizer(), 1])
        for bad in (0, -1.0, float("nan")):
            with self.assertRaises(ValueError):
                Reporter(self.path, composition_interval_s=bad)
        reporter = self.reporter()
        with self.assertRaises(TypeError):
            reporter.track(model="resnet")
        self.assertEqual(reporter.composition_interval_s, 10.0)


class EnableCompositionTest(EnvTestCase):
    def setUp(self):
        super().setUp()
        self.agent = FakeAgent(self.path)
        self.addCleanup(self.agent.close)

    def next_report(self, predicate=lambda report: True):
        while True:
            _, _, report = self.agent.next_line()
            if predicate(report):
                return report

    def test_round_trip_counted_on_the_reporter_thread(self):
        param = Parameter(1000, BFLOAT16)
        param.grad = Tensor(1000, BFLOAT16)
        model = CountingModule(param)
        optimizer = Optimizer([param])
        optimizer.adam_step()
        reporter = headroom_client.enable(
            self.path, interval_s=0.01, stats_provider=lambda: [device(0)],
            model=model, optimizer=optimizer,
        )
        report = self.next_report()
        self.assertEqual(report["v"], 2)
        self.assertEqual(report["pid"], os.getpid())
        self.assertEqual(
            report["devices"][0]["composition"],
            {"params": {"bfloat16": 2000}, "grads": {"bfloat16": 2000},
             "optimizer": {"bfloat16": 4000}},
        )
        # Counted once in the default 10 s, and never on the calling thread.
        self.next_report()
        self.next_report()
        self.assertEqual(model.threads, ["headroom-allocator-reporter"])
        self.assertEqual(reporter.composition_interval_s, 10.0)

    def test_later_enable_replaces_the_optimizer_and_plain_enable_keeps_it(self):
        model, optimizer = adam_model(1, numel=10)
        reporter = headroom_client.enable(
            self.path, interval_s=0.01, stats_provider=lambda: [device(0)],
            model=model, optimizer=optimizer,
        )
        self.assertEqual(self.next_report()["devices"][0]["composition"]["optimizer"],
                         {"float32": 80})
        _, replacement = adam_model(1, numel=100)
        self.assertIs(headroom_client.enable(optimizer=replacement, interval_s=5), reporter)
        self.assertEqual(reporter.interval_s, 0.01)  # other arguments still ignored

        def has_new_optimizer(report):
            return report["devices"][0]["composition"]["optimizer"] == {"float32": 800}

        report = self.next_report(has_new_optimizer)
        self.assertEqual(report["devices"][0]["composition"]["params"], {"float32": 40})
        self.assertIs(headroom_client.enable(), reporter)
        self.assertTrue(has_new_optimizer(self.next_report()))
        self.assertEqual(reporter.errors, 0)

    def test_plain_enable_sends_v1(self):
        headroom_client.enable(self.path, interval_s=0.01, stats_provider=lambda: [device(0)])
        _, _, report = self.agent.next_line()
        self.assertEqual(report["v"], 1)
        self.assertEqual(report["devices"], [device(0)])

    def test_invalid_model_raises_from_enable(self):
        with self.assertRaises(TypeError):
            headroom_client.enable(self.path, stats_provider=lambda: [], model=42)

    def test_disabled_reporter_still_accepts_tracking(self):
        os.environ["HEADROOM_ALLOCATOR_DISABLE"] = "1"
        model, optimizer = adam_model(1)
        reporter = headroom_client.enable(self.path, stats_provider=lambda: [device(0)],
                                          model=model, optimizer=optimizer)
        self.assertFalse(reporter.running)
        reporter.tick()
        self.agent.assert_no_line(self)


if __name__ == "__main__":
    unittest.main()
