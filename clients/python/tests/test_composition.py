import gc
import unittest

from headroom_client import _composition
from headroom_client._composition import CPU_INDEX, alive, hold, read_composition, read_with_retry

from ._fake_tensors import (
    BFLOAT16,
    CPU,
    FLOAT16,
    FLOAT32,
    INT64,
    DType,
    Device,
    DTensor,
    Module,
    Optimizer,
    OptimizerWrapper,
    Parameter,
    PlainTensor,
    Storage,
    StoragelessTensor,
    Tensor,
    Unreferenceable,
    ZeroParameter,
    adam_model,
    cuda,
)


def read(model=None, optimizer=None, **kwargs):
    models = None if model is None else [model]
    optimizers = None if optimizer is None else [optimizer]
    return read_composition(models, optimizers, **kwargs)


class CountTest(unittest.TestCase):
    def test_params_grads_and_optimizer_state_by_dtype(self):
        weight = Parameter(1000, FLOAT32)
        embedding = Parameter(500, BFLOAT16)
        weight.grad = Tensor(1000, FLOAT32)
        embedding.grad = Tensor(500, BFLOAT16)
        model = Module(weight, children=[Module(embedding)])
        optimizer = Optimizer([weight, embedding])
        optimizer.adam_step()
        self.assertEqual(
            read(model, optimizer),
            {
                0: {
                    "params": {"float32": 4000, "bfloat16": 1000},
                    "grads": {"float32": 4000, "bfloat16": 1000},
                    # the CPU "step" counts are not on the GPU
                    "optimizer": {"float32": 8000, "bfloat16": 2000},
                }
            },
        )

    def test_nothing_on_a_gpu_is_no_composition(self):
        self.assertEqual(read(Module(), Optimizer()), {})
        cpu_param = Parameter(10, device=CPU)
        self.assertEqual(read(Module(cpu_param)), {})

    def test_known_parts_are_empty_rather_than_missing(self):
        param = Parameter(10)
        optimizer = Optimizer([param])
        # no backward pass yet, no optimizer step yet
        self.assertEqual(
            read(Module(param), optimizer),
            {0: {"params": {"float32": 40}, "grads": {}, "optimizer": {}}},
        )

    def test_parts_not_tracked_are_left_out(self):
        model, optimizer = adam_model(2, numel=10)
        self.assertEqual(
            read(model), {0: {"params": {"float32": 80}, "grads": {"float32": 80}}}
        )
        # Without the model the optimizer's parameters are not counted.
        self.assertEqual(read(optimizer=optimizer), {0: {"optimizer": {"float32": 160}}})

    def test_a_shared_parameter_is_counted_once(self):
        shared = Parameter(100)
        shared.grad = Tensor(100)
        # The same object reached twice, and a distinct tensor object over
        # the same storage (tied weights after a wrapper re-created them).
        tied = Parameter(100, storage=shared.untyped_storage())
        tied.grad = shared.grad
        model = Module(shared, children=[Module(shared), Module(tied)])
        self.assertEqual(
            read(model), {0: {"params": {"float32": 400}, "grads": {"float32": 400}}}
        )

    def test_views_into_one_flat_buffer_are_counted_once(self):
        flat = Storage(4 * 1000)  # e.g. FSDP's flat parameter, or a DDP bucket
        params = [Parameter(250, storage=flat) for _ in range(4)]
        grads = Storage(4 * 1000)
        for param in params:
            param.grad = Tensor(250, storage=grads)
        self.assertEqual(
            read(Module(*params)), {0: {"params": {"float32": 4000}, "grads": {"float32": 4000}}}
        )

    def test_a_tensor_already_counted_in_an_earlier_part_is_not_counted_again(self):
        param = Parameter(10)
        optimizer = Optimizer([param])
        optimizer.state[param] = {"master": param, "momentum": Tensor(10)}
        self.assertEqual(
            read(Module(param), optimizer)[0],
            {"params": {"float32": 40}, "grads": {}, "optimizer": {"float32": 40}},
        )

    def test_several_devices(self):
        first = Parameter(100, device=cuda(0))
        second = Parameter(100, BFLOAT16, device=cuda(3))
        second.grad = Tensor(100, BFLOAT16, device=cuda(3))
        optimizer = Optimizer([first, second])
        optimizer.adam_step()
        self.assertEqual(
            read(Module(first, second), optimizer),
            {
                0: {"params": {"float32": 400}, "grads": {}, "optimizer": {"float32": 800}},
                3: {"params": {"bfloat16": 200}, "grads": {"bfloat16": 200},
                    "optimizer": {"bfloat16": 400}},
            },
        )

    def test_cpu_tensors_are_not_counted(self):
        # Optimizer state offloaded to CPU (ZeRO-Offload, FSDP CPU offload).
        param = Parameter(100)
        param.grad = Tensor(100, device=CPU)
        optimizer = Optimizer([param])
        optimizer.state[param] = {"exp_avg": Tensor(100, device=CPU)}
        self.assertEqual(
            read(Module(param, Parameter(7, device=CPU)), optimizer),
            {0: {"params": {"float32": 400}, "grads": {}, "optimizer": {}}},
        )
        # Other kinds of devices neither; a CUDA device without an index is skipped.
        self.assertEqual(
            read(Module(Parameter(5, device=Device("meta")), Parameter(5, device=Device("cuda")))),
            {},
        )

    def test_count_cpu_counts_cpu_tensors_apart(self):
        param = Parameter(100, device=CPU)
        param.grad = Tensor(100, device=CPU)
        gpu = Parameter(10)
        self.assertEqual(
            read(Module(param, gpu), count_cpu=True),
            {
                CPU_INDEX: {"params": {"float32": 400}, "grads": {"float32": 400}},
                0: {"params": {"float32": 40}, "grads": {}},
            },
        )

    def test_dtensor_counts_its_local_shard(self):
        # FSDP2 / tensor parallel: 8 ranks, this one holds an eighth.
        param = DTensor(8000, local=Tensor(1000, BFLOAT16))
        param.grad = DTensor(8000, local=Tensor(1000, BFLOAT16))
        fast = DTensor(8000, local=Tensor(1000, FLOAT32), with_local_attr=True)
        optimizer = Optimizer([param, fast])
        optimizer.state[param] = {"exp_avg": DTensor(8000, local=Tensor(1000, FLOAT32))}
        self.assertEqual(
            read(Module(param, fast), optimizer),
            {0: {"params": {"bfloat16": 2000, "float32": 4000}, "grads": {"bfloat16": 2000},
                 "optimizer": {"float32": 4000}}},
        )
        # _local_tensor is read directly: no autograd on the reporter thread.
        self.assertEqual(fast.to_local_calls, 0)
        self.assertEqual(param.to_local_calls, 1)

    def test_a_failing_to_local_is_skipped(self):
        class Broken(DTensor):
            def to_local(self):
                raise RuntimeError("process group destroyed")

        self.assertEqual(
            read(Module(Broken(8, Tensor(1)), Parameter(1))),
            {0: {"params": {"float32": 4}, "grads": {}}},
        )

    def test_zero3_parameter_counts_its_partition(self):
        partitioned = ZeroParameter(4000, partition_numel=1000)
        gathered = ZeroParameter(4000, partition_numel=1000, gathered=True)
        self.assertEqual(
            read(Module(partitioned, gathered)),
            # 1000 + (1000 + 4000 while gathered) elements of 4 bytes
            {0: {"params": {"float32": 24000}, "grads": {}}},
        )

    def test_an_empty_storage_counts_zero(self):
        # FSDP frees the unsharded parameter between uses.
        freed = Parameter(0, storage=Storage(0, data_ptr=0))
        self.assertEqual(read(Module(freed)), {0: {"params": {}, "grads": {}}})

    def test_without_untyped_storage_numel_times_element_size_once(self):
        plain = PlainTensor(100, FLOAT16)
        sparse = StoragelessTensor(10, INT64)
        optimizer = Optimizer()
        optimizer.state["a"] = {"buf": plain, "again": plain, "idx": sparse}
        self.assertEqual(read(optimizer=optimizer), {0: {"optimizer": {"float16": 200, "int64": 80}}})

    def test_dtype_names(self):
        self.assertEqual(_composition.dtype_name(BFLOAT16), "bfloat16")
        self.assertEqual(_composition.dtype_name("float8_e4m3fn"), "float8_e4m3fn")
        odd = DType("Weird Type", 1)
        self.assertEqual(read(Module(Parameter(3, odd)))[0]["params"], {"Weird Type": 3})

    def test_optimizer_state_values_in_lists_and_non_tensors(self):
        optimizer = Optimizer()
        optimizer.state["a"] = {
            "step": 3,
            "lr": 0.1,
            "nothing": None,
            "buffers": [Tensor(10), (Tensor(10),)],  # the tuple is two levels down
            "pair": (Tensor(5), "label"),
        }
        optimizer.state["b"] = Tensor(1)  # a tensor straight in the state
        self.assertEqual(read(optimizer=optimizer), {0: {"optimizer": {"float32": 64}}})

    def test_wrapped_optimizers_are_looked_through_three_levels(self):
        inner = Optimizer()
        inner.state["p"] = {"exp_avg": Tensor(10)}
        wrapped = inner
        for _ in range(3):
            wrapped = OptimizerWrapper(wrapped)
        self.assertEqual(read(optimizer=wrapped), {0: {"optimizer": {"float32": 40}}})
        self.assertEqual(read(optimizer=OptimizerWrapper(wrapped)), {})

    def test_several_models_and_optimizers(self):
        model_a, opt_a = adam_model(1, numel=10)
        model_b, opt_b = adam_model(1, numel=10, device=cuda(1))
        got = read_composition([model_a, model_b], [opt_a, opt_b])
        self.assertEqual(set(got), {0, 1})
        self.assertEqual(got[1]["optimizer"], {"float32": 80})


class MutationTest(unittest.TestCase):
    def test_a_change_during_the_walk_is_retried_once(self):
        class Changing(Module):
            walks = 0

            def parameters(self):
                Changing.walks += 1
                if Changing.walks == 1:
                    raise RuntimeError("dictionary changed size during iteration")
                return super().parameters()

        model = Changing(Parameter(10))
        self.assertEqual(read_with_retry([model], None)[0]["params"], {"float32": 40})
        self.assertEqual(Changing.walks, 2)

    def test_a_real_dict_mutated_during_iteration(self):
        # An optimizer whose state gains an entry while it is being walked,
        # as when the training thread takes its first step.
        optimizer = Optimizer()
        optimizer.state["p0"] = {"exp_avg": Tensor(1)}

        class Growing(dict):
            grown = 0

            def values(self):
                for value in dict.values(self):
                    if Growing.grown < 1:
                        Growing.grown += 1
                        self["p%d" % len(self)] = {"exp_avg": Tensor(1)}
                    yield value

        optimizer.state = Growing(optimizer.state)
        got = read_with_retry(None, [optimizer])
        self.assertEqual(got, {0: {"optimizer": {"float32": 8}}})

    def test_a_second_failure_propagates(self):
        class AlwaysChanging(Module):
            def parameters(self):
                raise RuntimeError("dictionary changed size during iteration")

        with self.assertRaises(RuntimeError):
            read_with_retry([AlwaysChanging()], None)


class HoldTest(unittest.TestCase):
    def test_held_weakly_and_forgotten_when_collected(self):
        model, optimizer = adam_model(1)
        models = hold(model, "model")
        optimizers = hold([optimizer], "optimizer")
        self.assertEqual(alive(models), [model])
        self.assertEqual(alive(optimizers), [optimizer])
        del model, optimizer
        gc.collect()
        self.assertIsNone(alive(models))
        self.assertIsNone(alive(optimizers))

    def test_objects_without_weak_references_are_held_strongly(self):
        refs = hold(Unreferenceable(Parameter(1)), "model")
        gc.collect()
        models = alive(refs)
        self.assertEqual(len(models), 1)
        self.assertEqual(read_composition(models, None)[0]["params"], {"float32": 4})

    def test_lists_and_tuples(self):
        a, b = Module(), Module()
        self.assertEqual(alive(hold((a, b), "model")), [a, b])
        self.assertIsNone(hold([], "model"))
        self.assertIsNone(alive(None))
        # One of two gone: the other still counts.
        refs = hold([a, b], "model")
        del a
        gc.collect()
        self.assertEqual(alive(refs), [b])

    def test_invalid_objects_are_refused(self):
        for bad in (3, "model", object(), [Module(), 5]):
            with self.assertRaises(TypeError):
                hold(bad, "model")
        for bad in (3, {}, [Optimizer(), object()]):
            with self.assertRaises(TypeError):
                hold(bad, "optimizer")
        hold(OptimizerWrapper(Optimizer()), "optimizer")  # e.g. an LR scheduler


if __name__ == "__main__":
    unittest.main()
