"""The background loop that keeps episodes in flight while the trainer trains.

An asyncio loop in a daemon thread launches groups (G episodes of one task) as long as the
staleness gate allows, runs at most ``max_in_flight`` episodes at once (generation and tool calls
overlap across episodes), and puts each finished group into the :class:`RolloutBuffer`. The
trainer thread takes whole groups and pushes new weights through :meth:`update_weights`.

Staleness gate: with the engine at policy version v (weights after v optimizer steps), at most
``(v + 1 + max_staleness) * groups_per_step`` groups have been started. With ``max_staleness = 0``
this is synchronous on-policy training: batch k is generated entirely by the weights of step k.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from lightning_agentrl.rollout.agent_loop import EpisodeBudget, run_episode
from lightning_agentrl.rollout.buffer import RolloutBuffer
from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.rollout.engine import GenerationEngine, SamplingParams
from lightning_agentrl.tasks import Task
from lightning_agentrl.trajectory import Trajectory


@dataclass(frozen=True)
class RolloutPlan:
    group_size: int
    groups_per_step: int
    max_in_flight: int
    max_staleness: int
    seed: int = 0


class RolloutService:
    """Owns the event loop, the engine, the sandbox client and the buffer."""

    def __init__(
        self,
        *,
        engine: GenerationEngine,
        make_client: Callable[[], object],
        make_env: Callable[[object, Task], object],
        codec: ChatCodec,
        tasks: list[Task],
        sampling: SamplingParams,
        budget: EpisodeBudget,
        plan: RolloutPlan,
    ) -> None:
        if not tasks:
            raise ValueError("no tasks to roll out")
        self.engine = engine
        self.make_client = make_client
        self.make_env = make_env
        self.codec = codec
        self.tasks = list(tasks)
        self.sampling = sampling
        self.budget = budget
        self.plan = plan
        self.buffer = RolloutBuffer(plan.max_staleness)
        self.engine_version = engine.policy_version
        self._next_group = 0
        self._pending: set[int] = set()  # started, not finished: restarted after a resume
        self._restart: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._gate: asyncio.Event | None = None
        self._started = threading.Event()
        self._initial: tuple[list[tuple[str, torch.Tensor]], int] | None = None
        self.num_in_flight = 0
        self.num_episodes_finished = 0

    # -- task order --------------------------------------------------------------------------
    def task_for_group(self, group_id: int) -> Task:
        """Deterministic in the group id alone: an epoch is a seeded permutation of the tasks."""
        epoch, index = divmod(group_id, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(self.plan.seed * 100_003 + epoch).shuffle(order)
        return self.tasks[order[index]]

    # -- lifecycle ---------------------------------------------------------------------------
    def start(
        self, initial_weights: Iterable[tuple[str, torch.Tensor]] | None = None, version: int | None = None
    ) -> RolloutService:
        """Start the loop; with ``initial_weights`` the engine loads them before any episode starts."""
        if self._thread is not None:
            return self
        if initial_weights is not None:
            assert version is not None, "initial weights need their policy version"
            self._initial = ([(n, t.detach().clone()) for n, t in initial_weights], version)
        self._thread = threading.Thread(target=self._run_loop, name="rollout-service", daemon=True)
        self._thread.start()
        self._started.wait()
        return self

    def _run_loop(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._gate = asyncio.Event()
        self._started.set()
        try:
            self._loop.run_until_complete(self._produce())
        except asyncio.CancelledError:
            pass
        except BaseException as err:  # never leave the trainer waiting on a dead producer
            self.buffer.fail(err)
        finally:
            self._loop.run_until_complete(self.engine.close())
            self._loop.close()

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        loop = self._loop

        def cancel_all() -> None:
            for task in asyncio.all_tasks(loop):
                task.cancel()

        loop.call_soon_threadsafe(cancel_all)
        self._thread.join(timeout=60)
        self._thread = None

    def __enter__(self) -> RolloutService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- trainer side ------------------------------------------------------------------------
    def take_batch(self, policy_version: int, timeout_s: float | None = None) -> list[Trajectory]:
        groups = self.buffer.take(self.plan.groups_per_step, policy_version, timeout_s=timeout_s)
        return [t for group in groups for t in group]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push weights to the engine (blocks until loaded) and open the staleness gate."""
        assert self._loop is not None, "start() first"
        named = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
        future = asyncio.run_coroutine_threadsafe(self._update(named, version), self._loop)
        future.result()

    async def _update(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        await self.engine.update_weights(named, version)
        self.engine_version = version
        self._gate.set()

    # -- producer ----------------------------------------------------------------------------
    def _groups_allowed(self) -> int:
        return (self.engine_version + 1 + self.plan.max_staleness) * self.plan.groups_per_step

    async def _produce(self) -> None:
        if self._initial is not None:
            await self._update(*self._initial)
            self._initial = None
        slots = asyncio.Semaphore(self.plan.max_in_flight)
        client = self.make_client()
        running: set[asyncio.Task] = set()
        try:
            while True:
                if self._restart:
                    group_id = self._restart.pop(0)
                else:
                    while self._next_group >= self._groups_allowed():
                        self._gate.clear()
                        await self._gate.wait()
                    group_id = self._next_group
                    self._next_group += 1
                self._pending.add(group_id)
                task = asyncio.create_task(self._run_group(client, slots, group_id))
                running.add(task)
                task.add_done_callback(running.discard)
                task.add_done_callback(self._check_failed)
                await asyncio.sleep(0)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await client.close()

    def _check_failed(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.buffer.fail(task.exception())

    async def _run_group(self, client, slots: asyncio.Semaphore, group_id: int) -> None:
        task = self.task_for_group(group_id)
        episodes = [self._run_episode(client, slots, task, group_id, i) for i in range(self.plan.group_size)]
        trajectories = await asyncio.gather(*episodes)
        self._pending.discard(group_id)
        self.buffer.put(list(trajectories))

    async def _run_episode(self, client, slots: asyncio.Semaphore, task: Task, group_id: int, index: int) -> Trajectory:
        async with slots:
            self.num_in_flight += 1
            try:
                trajectory = await run_episode(
                    engine=self.engine,
                    env=self.make_env(client, task),
                    codec=self.codec,
                    sampling=self.sampling,
                    budget=self.budget,
                    episode_id=f"g{group_id}-e{index}",
                    task_id=task.id,
                    group_id=group_id,
                )
            finally:
                self.num_in_flight -= 1
            self.num_episodes_finished += 1
            return trajectory

    # -- resume ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "next_group": self._next_group,
            "restart": sorted(self._pending | set(self._restart)),
            "buffer": self.buffer.state_dict(),
            "num_episodes_finished": self.num_episodes_finished,
        }

    def load_state_dict(self, state: dict) -> None:
        assert self._thread is None, "load state before start()"
        self._next_group = state["next_group"]
        self._restart = list(state["restart"])
        self.buffer.load_state_dict(state["buffer"])
        self.num_episodes_finished = state["num_episodes_finished"]
