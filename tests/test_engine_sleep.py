"""Colocation: the vLLM engine sleeps through optimizer steps and wakes for generation.

vLLM's sleep mode needs CUDA: vllm-cpu refuses ``enable_sleep_mode`` ("Sleep mode is not supported
on current platform"), so these tests drive ``VLLMEngine``'s own logic (gate, drain, order of the
sleep / wake / reload calls) against fake replicas that record what they were asked. The fakes
stand in for ``AsyncLLM`` at its edge only: ``sleep``, ``wake_up(tags)``, ``collective_rpc``,
``reset_prefix_cache``, ``pause_generation`` / ``resume_generation``. What a GPU must still show
(memory really freed and restored) is in ``scripts/gpu_smoke.sh``'s notes.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading

import pytest
import torch

from lightning_agentrl.callbacks.engine_sleep import EngineSleep, engine_sleep_callbacks
from lightning_agentrl.rollout.engine import SamplingParams
from lightning_agentrl.rollout.vllm_engine import VLLMEngine
from lightning_agentrl.rollout.vllm_worker import RELOAD_METHOD


class FakeReplica:
    """Records the calls an ``AsyncLLM`` receives."""

    errored = False  # AsyncLLM.errored: its engine process died

    def __init__(self, calls: list) -> None:
        self.calls = calls

    async def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    async def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    async def collective_rpc(self, method, args=()) -> None:
        self.calls.append(("rpc", method))

    async def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    async def pause_generation(self, **kwargs) -> None:
        self.calls.append(("pause_generation",))

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation",))


@pytest.fixture
def model_dir(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    return tmp_path


def engine_with_fakes(model_dir, num_replicas=2, sleep_mode=True):
    engine = VLLMEngine(str(model_dir), num_replicas=num_replicas, sleep_mode=sleep_mode)
    calls: list = []
    engine._ensure_events()
    engine._replicas = [FakeReplica(calls) for _ in range(num_replicas)]
    return engine, calls


WEIGHTS = [("model.embed_tokens.weight", torch.ones(4, 2))]


def test_sleep_mode_is_passed_to_vllm_only_when_asked(model_dir):
    assert VLLMEngine(str(model_dir), sleep_mode=True)._engine_args["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in VLLMEngine(str(model_dir))._engine_args
    args = VLLMEngine(str(model_dir), kv_cache_memory_bytes=None, gpu_memory_utilization=0.8)._engine_args
    assert args["gpu_memory_utilization"] == 0.8 and "kv_cache_memory_bytes" not in args


def test_sleep_update_wake_call_order_and_gate(model_dir):
    async def scenario():
        engine, calls = engine_with_fakes(model_dir)
        await engine.sleep()
        assert engine.sleeping and not engine._admission_open.is_set()
        assert calls == [("sleep", 1), ("sleep", 1)]
        calls.clear()
        await engine.update_weights(WEIGHTS, version=1)
        # only the weights wake; no pause/resume (nothing can be in flight); the gate stays shut
        assert calls == [("wake_up", ("weights",)), ("wake_up", ("weights",)), ("rpc", RELOAD_METHOD), ("rpc", RELOAD_METHOD)]
        assert engine.policy_version == 1 and not engine._admission_open.is_set()
        calls.clear()
        await engine.wake_up()
        assert calls == [("wake_up", ("kv_cache",)), ("wake_up", ("kv_cache",)),
                         ("reset_prefix_cache",), ("reset_prefix_cache",)]
        assert not engine.sleeping and engine._admission_open.is_set()
        calls.clear()
        await engine.wake_up()  # idempotent
        await engine.update_weights(WEIGHTS, version=2)  # awake: the usual pause/reload/resume
        per_replica = [("pause_generation",), ("rpc", RELOAD_METHOD), ("reset_prefix_cache",), ("resume_generation",)]
        assert calls == per_replica * 2
        assert engine.num_sleeps == 1

    asyncio.run(scenario())


class HangingReplica(FakeReplica):
    """A replica whose engine process was killed: vLLM's pause call waits for a reply that never comes."""

    async def pause_generation(self, **kwargs) -> None:
        self.calls.append(("pause_generation",))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.calls.append(("cancelled",))
            raise


def test_a_weight_update_on_a_dead_engine_process_raises_instead_of_waiting_forever(model_dir):
    from lightning_agentrl.rollout.vllm_engine import ENGINE_DEATH_POLL_S, EngineDeadError

    async def scenario():
        engine, calls = engine_with_fakes(model_dir, num_replicas=2, sleep_mode=False)
        engine._replicas[1] = HangingReplica(calls)
        update = asyncio.create_task(engine.update_weights(WEIGHTS, version=1))
        await asyncio.sleep(3 * ENGINE_DEATH_POLL_S)
        assert not update.done()  # alive and slow: it waits
        engine._replicas[1].errored = True
        started = asyncio.get_running_loop().time()
        with pytest.raises(EngineDeadError, match="the vLLM engine of replica 1 is dead"):
            await update
        assert asyncio.get_running_loop().time() - started < 3 * ENGINE_DEATH_POLL_S
        assert ("cancelled",) in calls and engine.policy_version == 0
        with pytest.raises(EngineDeadError, match="replica 1 is dead"):  # the engine stays unusable
            await engine.update_weights(WEIGHTS, version=2)

    asyncio.run(scenario())


class DeadReplica(FakeReplica):
    """A replica whose engine process died and vLLM saw it: ``errored``, and every call fails at once."""

    errored = True

    async def _fail(self, *args, **kwargs) -> None:
        raise RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause.")

    sleep = wake_up = collective_rpc = reset_prefix_cache = pause_generation = resume_generation = _fail


def test_a_death_vllm_saw_first_is_named_and_leaves_the_engine_unusable(model_dir):
    from lightning_agentrl.rollout.vllm_engine import EngineDeadError

    async def scenario():
        for method in ("update", "sleep"):
            engine, calls = engine_with_fakes(model_dir, num_replicas=2)
            engine._replicas[1] = DeadReplica(calls)
            with pytest.raises(EngineDeadError, match="the vLLM engine of replica 1 is dead"):
                await (engine.update_weights(WEIGHTS, version=1) if method == "update" else engine.sleep())
            assert calls == [] and isinstance(engine._dead, EngineDeadError), method  # nothing was asked of vLLM

    asyncio.run(scenario())


def test_a_sleeping_engine_that_died_is_not_woken_and_its_callback_keeps_the_runs_error(model_dir, caplog):
    """The engine dies during a step: the weight sync raises, and the wake-up after the failed step
    (EngineSleep.on_exception) touches no replica, reopens the gate to the engine's error, and never raises."""
    from lightning_agentrl.rollout.vllm_engine import EngineDeadError

    async def scenario():
        engine, calls = engine_with_fakes(model_dir, num_replicas=1)
        await engine.sleep()
        engine._replicas[0] = DeadReplica(calls)
        with pytest.raises(EngineDeadError, match="replica 0 is dead"):
            await engine.update_weights(WEIGHTS, version=1)
        calls.clear()
        await engine.wake_up()
        assert calls == [] and not engine.sleeping and engine._admission_open.is_set()
        with pytest.raises(EngineDeadError, match="unusable after"):
            await engine.generate([1, 2], SamplingParams(max_new_tokens=2), "session")

    asyncio.run(scenario())

    class Failing:  # an engine whose wake-up fails, in a loop of its own thread (the rollout service's)
        sleep_mode = sleeping = True
        loop = asyncio.new_event_loop()

        async def wake_up(self):
            raise EngineDeadError("the vLLM engine of replica 0 is dead")

    engine = Failing()
    thread = threading.Thread(target=engine.loop.run_forever, daemon=True)
    thread.start()
    try:
        with caplog.at_level("WARNING"):
            EngineSleep(engine).on_exception(None, None, RuntimeError("the run's own error"))
    finally:
        engine.loop.call_soon_threadsafe(engine.loop.stop)
        thread.join(timeout=5)
    assert "the engine did not wake after the run failed: EngineDeadError" in caplog.text


def test_closing_the_engine_ends_a_weight_update_waiting_on_a_stuck_replica_without_stray_errors(model_dir):
    """close() empties the replica list and shuts the replicas down (vLLM then marks them errored): the
    update waiting on them ends with EngineDeadError, and asyncio logs no unread error of the cancelled calls."""
    from lightning_agentrl.rollout.vllm_engine import ENGINE_DEATH_POLL_S, EngineDeadError

    class ClosingReplica(HangingReplica):
        def shutdown(self, timeout=None) -> None:
            self.errored = True

    unread: list = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unread.append(context["message"]))
        engine, calls = engine_with_fakes(model_dir, num_replicas=1, sleep_mode=False)
        engine._replicas[0] = ClosingReplica(calls)
        update = asyncio.create_task(engine.update_weights(WEIGHTS, version=1))
        await asyncio.sleep(ENGINE_DEATH_POLL_S)
        await engine.close()
        with pytest.raises(EngineDeadError, match="replica 0 is dead"):
            await asyncio.wait_for(update, timeout=5 * ENGINE_DEATH_POLL_S)
        del update
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert unread == []


def test_torch_cached_memory_is_released_before_each_wake(model_dir, monkeypatch):
    """The trainer's freed activations stay reserved by torch's caching allocator unless returned."""
    import lightning_agentrl.rollout.vllm_engine as vllm_engine

    async def scenario():
        engine, calls = engine_with_fakes(model_dir, num_replicas=1)
        monkeypatch.setattr(vllm_engine.torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(vllm_engine.torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
        await engine.sleep()
        await engine.update_weights(WEIGHTS, version=1)
        await engine.wake_up()
        assert calls == [("sleep", 1), ("empty_cache",), ("wake_up", ("weights",)), ("rpc", RELOAD_METHOD),
                         ("empty_cache",), ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]

    asyncio.run(scenario())


def test_wake_without_update_restores_everything_and_keeps_the_prefix_cache_reset_by_sleep(model_dir):
    async def scenario():
        engine, calls = engine_with_fakes(model_dir, num_replicas=1)
        await engine.sleep(level=2)
        await engine.sleep(level=2)  # idempotent
        await engine.wake_up()
        assert calls == [("sleep", 2), ("wake_up", ("weights", "kv_cache"))]

    asyncio.run(scenario())


def test_sleep_waits_for_requests_in_flight(model_dir):
    async def scenario():
        engine, calls = engine_with_fakes(model_dir, num_replicas=1)
        engine._drained.clear()  # one request in flight
        sleeping = asyncio.create_task(engine.sleep())
        await asyncio.sleep(0.05)
        assert calls == [] and not engine._admission_open.is_set()  # new requests already wait
        engine._drained.set()  # it finished
        await sleeping
        assert calls == [("sleep", 1)]

    asyncio.run(scenario())


def test_an_engine_without_sleep_mode_refuses_to_sleep(model_dir):
    async def scenario():
        engine, _ = engine_with_fakes(model_dir, sleep_mode=False)
        with pytest.raises(RuntimeError, match="sleep_mode=False"):
            await engine.sleep()

    asyncio.run(scenario())
    assert engine_sleep_callbacks(VLLMEngine(str(model_dir))) == []
    with pytest.raises(ValueError, match="sleep_mode=True"):
        EngineSleep(VLLMEngine(str(model_dir)))


def test_callback_sleeps_the_engine_in_its_own_loop_for_the_step(model_dir):
    """The trainer thread drives an engine living in the rollout service's loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        engine, calls = asyncio.run_coroutine_threadsafe(_build(model_dir), loop).result()
        (callback,) = engine_sleep_callbacks(engine)
        callback.on_train_batch_start(None, None, None, 0)
        assert engine.sleeping and calls == [("sleep", 1)]
        callback.on_train_batch_end(None, None, None, None, 0)
        assert not engine.sleeping and calls[-1] == ("wake_up", ("weights", "kv_cache"))
        callback.on_train_batch_start(None, None, None, 1)
        callback.on_exception(None, None, RuntimeError("step failed"))  # never leave it asleep
        assert not engine.sleeping
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


async def _build(model_dir):
    return engine_with_fakes(model_dir, num_replicas=1)


def test_callback_does_nothing_for_an_engine_that_never_started(model_dir):
    engine = VLLMEngine(str(model_dir), sleep_mode=True)
    callback = EngineSleep(engine)
    callback.on_train_batch_start(None, None, None, 0)  # no loop yet: it holds no memory
    assert not engine.sleeping


def test_vllm_cpu_has_no_sleep_mode():
    """Why the tests above use fakes: on a CPU platform vLLM reports sleep mode unavailable."""
    platforms = pytest.importorskip("vllm.platforms")
    if platforms.current_platform.is_cuda_alike():
        pytest.skip("a CUDA platform: sleep mode is available here")
    assert not platforms.current_platform.is_sleep_mode_available()
