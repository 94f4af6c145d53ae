"""The background loop that keeps episodes in flight while the trainer trains.

An asyncio loop in a daemon thread launches groups (G episodes of one task) as long as the
staleness gate allows, runs at most ``max_in_flight`` episodes at once (generation and tool calls
overlap across episodes), and puts each finished group into the :class:`RolloutBuffer`. The
trainer thread takes whole groups and pushes new weights through :meth:`update_weights`.

Staleness gate: with the engine at policy version v (weights after v optimizer steps), at most
``(v + 1 + max_staleness) * groups_per_step`` groups have been started, plus one for every group
the buffer dropped as stale or discarded (dynamic sampling): those are replaced, so the service keeps
running ahead as far as the bound allows. With ``max_staleness = 0`` this is synchronous on-policy
training: batch k is generated entirely by the weights of step k. Versions count optimizer steps,
and the engine's version advances only when weights are pushed: with ``sync_weights_every = k`` the
engine serves weights up to k - 1 versions old, so the settings require ``max_staleness >= k - 1``.

Dynamic sampling (``dynamic_sampling``, DAPO): the buffer discards groups without reward variance
and the gate lets a replacement start for each, within ``max_sampling_rounds`` (see
:class:`RolloutBuffer`).

Partial rollouts (``partial_rollout_s``, Kimi-Researcher): an episode that has run that long in
the current iteration is parked at its next turn boundary, releases its slot, and continues once
the engine has newer weights; its group is ready when all of its episodes have ended. If every
running episode is parked and nothing else can make progress (the gate is closed and the trainer
waits on the buffer for groups, so no newer weights can come), parked episodes continue with the
current weights rather than wait forever.
Parked episodes, and the finished episodes of unfinished groups, are part of :meth:`state_dict`;
a restored parked episode rebuilds its environment around the saved sandbox id (if the sandbox
is gone, its next tool call ends the episode with ``sandbox_error``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch

from lightning_agentrl.envs.base import Environment
from lightning_agentrl.envs.registry import EnvTask as Task  # any environment's task: an object with an id
from lightning_agentrl.lora import engine_weights
from lightning_agentrl.rollout.agent_loop import (
    EpisodeBudget,
    EpisodeState,
    ParkedEpisode,
    play_episode,
    restore_env_state,
)
from lightning_agentrl.rollout.buffer import RolloutBuffer, RolloutServiceError
from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.rollout.engine import GenerationEngine, SamplingParams
from lightning_agentrl.rollout.summarize import Summarizer
from lightning_agentrl.settings import RolloutSettings
from lightning_agentrl.trajectory import Trajectory

log = logging.getLogger(__name__)


def _rollout_default(name: str):
    return RolloutSettings.model_fields[name].default


@dataclass(frozen=True)
class RolloutPlan:
    """How the service groups, bounds and re-samples episodes: the ``rollout`` settings of the same names, with
    their defaults (documented there), and the run's seed."""

    group_size: int
    groups_per_step: int
    max_in_flight: int
    max_staleness: int
    seed: int = 0
    partial_rollout_s: float | None = _rollout_default("partial_rollout_s")
    dynamic_sampling: bool = _rollout_default("dynamic_sampling")
    max_sampling_rounds: int = _rollout_default("max_sampling_rounds")

    def __post_init__(self) -> None:
        if self.max_sampling_rounds < 1:
            raise ValueError(f"rollout.max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        if self.partial_rollout_s is not None:
            if self.partial_rollout_s < 0:
                raise ValueError(f"rollout.partial_rollout_s must be >= 0, got {self.partial_rollout_s}")
            if self.max_staleness < 1:
                raise ValueError(
                    "rollout.partial_rollout_s needs rollout.max_staleness >= 1: a parked episode continues "
                    "with newer weights, so its group always mixes two policy versions"
                )

    @classmethod
    def from_settings(cls, rollout, *, seed: int) -> RolloutPlan:
        """From a ``RolloutSettings`` section (the fields of the same names) and the run's seed."""
        names = [name for name in cls.__dataclass_fields__ if name != "seed"]
        return cls(**{name: getattr(rollout, name) for name in names}, seed=seed)


@dataclass
class _GroupProgress:
    """A started group: its finished episodes and its parked ones, by index in the group."""

    finished: dict[int, Trajectory] = field(default_factory=dict)
    parked: dict[int, ParkedEpisode] = field(default_factory=dict)


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
        summarizer: Summarizer | None = None,
        episode_budget: Callable[[EpisodeBudget, int, int], EpisodeBudget] | None = None,
        play: Callable = play_episode,
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
        self.summarizer = summarizer
        self.episode_budget = episode_budget  # (budget, group id, index) -> that episode's budget; e.g. an experiment's
        self.play = play  # plays one episode: the built-in loop, or an external agent's (rollout/gateway.py)
        self.buffer = RolloutBuffer(
            plan.max_staleness, dynamic_sampling=plan.dynamic_sampling, max_sampling_rounds=plan.max_sampling_rounds
        )
        self.buffer.on_change = self._buffer_changed
        self.engine_version = engine.policy_version
        self._next_group = 0
        self._pending: set[int] = set()  # started, not finished: restarted after a resume
        self._restart: list[int] = []
        self._progress: dict[int, _GroupProgress] = {}
        self._changed: asyncio.Condition | None = None  # version bumped, an episode ended or parked
        self._at_gate = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._gate: asyncio.Event | None = None
        self._started = threading.Event()
        self._initial: tuple[list[tuple[str, torch.Tensor]], int] | None = None
        self._stopping = False  # the service cancels its tasks: a cancelled group is then no failure
        self._watchdog: LoopWatchdog | None = None
        self.num_in_flight = 0
        self.sandbox_client = None  # the training episodes' (a fleet's counts its live servers)
        self.num_episodes_finished = 0
        self.num_groups_finished = 0
        self.num_parks = 0  # times an episode was parked (one episode may park several times)
        self.num_skipped_steps = 0  # trainer steps without an optimizer step: each allows a step of groups
        self.rank, self.world_size = 0, 1
        self._groups_per_step_total = plan.groups_per_step

    def shard(self, rank: int, world_size: int) -> None:
        """Produce rank ``rank``'s share of each step: ``groups_per_step / world_size`` whole groups
        (a group is never split), with group ids ``rank, rank + world_size, ...``. Group ids choose
        the task and seed the sampling, so the ranks together draw what one process would."""
        if self._thread is not None:
            raise RuntimeError("shard() before start()")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        total = self._groups_per_step_total
        if total % world_size:
            raise ValueError(
                f"rollout.groups_per_step ({total}) must be a multiple of the number of "
                f"training processes ({world_size}): each process trains on whole groups"
            )
        self.plan = replace(self.plan, groups_per_step=total // world_size)
        self.rank, self.world_size = rank, world_size

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
        self._watchdog = LoopWatchdog(self._loop, self._thread, self.budget.episode_timeout_s, self.buffer.fail)
        self._watchdog.start()
        return self

    def _run_loop(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._gate = asyncio.Event()
        self._changed = asyncio.Condition()
        self._started.set()
        try:
            self._loop.run_until_complete(self._produce())
        except asyncio.CancelledError:
            pass
        except BaseException as err:  # never leave the trainer waiting on a dead producer
            self.buffer.fail(err)
        finally:
            self._loop.run_until_complete(self.engine.close())
            leftover = asyncio.all_tasks(self._loop)  # e.g. a sub-agent engine's worker: cancelled, not leaked
            for task in leftover:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
            self._loop.close()

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        loop = self._loop

        def cancel_all() -> None:
            self._stopping = True
            for task in asyncio.all_tasks(loop):
                task.cancel()

        try:
            loop.call_soon_threadsafe(cancel_all)
        except RuntimeError:  # the loop already ended (its failure is in the buffer): nothing to cancel
            pass
        blocked = self._watchdog is not None and self._watchdog.blocked_by is not None
        self._thread.join(timeout=5 if blocked else 60)  # a loop an environment blocks may never return
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
        """Push weights to the engine (blocks until loaded) and open the staleness gate.

        No copy is made: the call returns only once the engine has loaded them, so the caller cannot change
        them meanwhile (a clone here was a second full copy of the weights at every sync: 0.6 GiB of
        SmolLM2-135M in float32, docs/memory_plan.md)."""
        assert self._loop is not None, "start() first"
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        future = asyncio.run_coroutine_threadsafe(self._update(named, version), self._loop)
        try:
            future.result()
        except Exception as err:  # e.g. an engine process that died: the run cannot go on
            raise RolloutServiceError(f"the engine could not load the weights of version {version}") from err

    def sync_weights(self, policy: torch.nn.Module, version: int) -> None:
        """Push the trained policy's weights to the engine as ``version``: every weight, or under LoRA the
        adapters only (:func:`lightning_agentrl.lora.engine_weights`). Under ZeRO-3 every rank calls it (the
        weights are gathered collectively)."""
        self.update_weights(engine_weights(policy).items(), version=version)

    async def _update(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        await self.engine.update_weights(named, version)
        self.engine_version = version
        self._gate.set()
        await self._notify()

    def skip_step(self) -> None:
        """The trainer took no optimizer step on its last batch (nothing to train on): allow one more
        step of groups at the current weights, since no weight update will open the gate."""
        assert self._loop is not None, "start() first"
        asyncio.run_coroutine_threadsafe(self._skip(), self._loop).result()

    async def _skip(self) -> None:
        self.num_skipped_steps += 1
        self._gate.set()
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def metrics(self) -> dict[str, float]:
        """The service's own counters for the step's metrics: episodes in flight, groups started but never
        trained (each replaced by another), what generation cost, and the live servers of an engine or sandbox
        fleet (where there is one)."""
        buffer = self.buffer
        out = {
            "rollout/in_flight": float(self.num_in_flight),
            "rollout/dropped_stale_groups": float(buffer.num_dropped_stale),
            "rollout/discarded_groups": float(buffer.num_discarded),  # dynamic sampling, cumulative
            "rollout/filled_groups": float(buffer.num_filled),  # dynamic sampling budget spent, cumulative
            "rollout/step_discarded_groups": float(buffer.last_take["discarded"]),
            "rollout/episodes_generated": float(self.num_episodes_finished),
        }
        live = getattr(self.engine, "num_live_servers", None)  # a server fleet's
        if live is not None:
            out["rollout/engine_servers_live"] = float(live)
        live = getattr(self.sandbox_client, "live_servers", None)  # a sandbox fleet's (averaged over ranks)
        if live is not None:
            out["sandbox/servers_live"] = float(live)
        return out

    def interrupt(self, error: BaseException) -> None:
        """Wake the trainer waiting for a batch with ``error`` (a stop signal) instead of letting it wait."""
        self.buffer.fail(error)

    @property
    def num_parked(self) -> int:
        """Episodes parked right now, waiting for newer weights."""
        return sum(len(p.parked) for p in list(self._progress.values()))

    # -- producer ----------------------------------------------------------------------------
    def _groups_allowed(self) -> int:
        steps = self.engine_version + 1 + self.plan.max_staleness + self.num_skipped_steps
        return steps * self.plan.groups_per_step + self.buffer.num_removed

    def _budget_of(self, group_id: int, index: int) -> EpisodeBudget:
        return self.budget if self.episode_budget is None else self.episode_budget(self.budget, group_id, index)

    def _buffer_changed(self) -> None:
        """On the trainer's thread: groups were dropped (replacements may start) or a take waits
        (parked episodes may be all that can progress). Re-check the gate and the parked episodes."""
        loop = self._loop
        if loop is None or self._gate is None:
            return
        try:
            loop.call_soon_threadsafe(self._recheck)
        except RuntimeError:  # the loop has closed: the service is stopping
            pass

    def _recheck(self) -> None:
        self._gate.set()
        asyncio.ensure_future(self._notify())

    async def _produce(self) -> None:
        if self._initial is not None:
            await self._update(*self._initial)
            self._initial = None
        slots = asyncio.Semaphore(self.plan.max_in_flight)
        client = self.sandbox_client = self.make_client()
        running: set[asyncio.Task] = set()
        try:
            while True:
                if self._restart:
                    group_id = self._restart.pop(0)
                else:
                    while self._next_group >= self._groups_allowed():
                        self._gate.clear()
                        self._at_gate = True
                        await self._notify()
                        await self._gate.wait()
                    self._at_gate = False
                    group_id = self._next_group * self.world_size + self.rank
                    self._next_group += 1
                self._pending.add(group_id)
                task = asyncio.create_task(self._run_group(client, slots, group_id), name=f"group {group_id}")
                running.add(task)
                task.add_done_callback(running.discard)
                task.add_done_callback(self._check_failed)
                await asyncio.sleep(0)
        finally:
            self._stopping = True
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            if client is not None:  # None: the environment uses no sandbox service
                await client.close()

    def _check_failed(self, task: asyncio.Task) -> None:
        if task.cancelled():
            if not self._stopping:  # nothing of the service cancelled it: the group would never reach the buffer
                self.buffer.fail(RolloutServiceError(f"a rollout group was cancelled ({task.get_name()}) while "
                                                     "the service was running"))
        elif task.exception() is not None:
            self.buffer.fail(task.exception())

    async def _run_group(self, client, slots: asyncio.Semaphore, group_id: int) -> None:
        task = self.task_for_group(group_id)
        progress = self._progress.setdefault(group_id, _GroupProgress())
        todo = [i for i in range(self.plan.group_size) if i not in progress.finished]
        await asyncio.gather(*(self._run_episode(client, slots, task, group_id, i, progress) for i in todo))
        trajectories = [progress.finished[i] for i in range(self.plan.group_size)]
        self._progress.pop(group_id, None)
        self._pending.discard(group_id)
        self.buffer.put(trajectories)
        self.num_groups_finished += 1
        await self._notify()  # the progress entry is gone: parked episodes may now be all that is left

    def _stalled(self) -> bool:
        """Nothing but parked episodes could make progress: no episode runs, no group may start, and
        the trainer waits on the buffer for groups (so no newer weights will ever come)."""
        return (
            self.num_in_flight == 0
            and self._at_gate
            and self.buffer.starved
            # a group whose episodes all ended is about to reach the buffer: not stalled
            and all(progress.parked for progress in self._progress.values())
        )

    async def _run_episode(
        self, client, slots: asyncio.Semaphore, task: Task, group_id: int, index: int, progress: _GroupProgress
    ) -> None:
        parked = progress.parked.get(index)
        while True:
            if parked is not None:
                version = parked.state.parked_version
                async with self._changed:
                    await self._changed.wait_for(lambda v=version: self.engine_version > v or self._stalled())
                progress.parked.pop(index, None)
            async with slots:
                self.num_in_flight += 1
                try:
                    if parked is None:
                        env, resume = self.make_env(client, task), None
                    else:
                        env = parked.env or restore_env_state(self.make_env(client, task), parked.state.env_state)
                        resume = parked.state
                    outcome = await self.play(
                        engine=self.engine,
                        env=env,
                        codec=self.codec,
                        sampling=self.sampling,
                        budget=self._budget_of(group_id, index),
                        episode_id=f"g{group_id}-e{index}",
                        task_id=task.id,
                        group_id=group_id,
                        summarizer=self.summarizer,
                        resume=resume,
                        park_after_s=self.plan.partial_rollout_s,
                    )
                finally:
                    self.num_in_flight -= 1
            if isinstance(outcome, Trajectory):
                progress.finished[index] = outcome
                self.num_episodes_finished += 1
                await self._notify()
                return
            parked = outcome
            progress.parked[index] = parked
            self.num_parks += 1
            await self._notify()

    # -- held-out evaluation -------------------------------------------------------------------
    def play_episodes(
        self, tasks: list[Task], *, samples_per_task: int, sampling: SamplingParams, tag: str
    ) -> list[Trajectory]:
        """Play ``samples_per_task`` episodes of each of ``tasks``, not for training, on the service's
        loop beside the training episodes, with its engine, codec, budget and sandbox service; block
        until they end. Episode ids are ``<tag>-<task id>-<sample>``; group ids the task's index."""
        assert self._loop is not None and self._thread is not None, "start() first"
        coroutine = self.play_episodes_async(tasks, samples_per_task=samples_per_task, sampling=sampling, tag=tag)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def play_episodes_async(
        self, tasks: list[Task], *, samples_per_task: int, sampling: SamplingParams, tag: str, on_episode=None
    ) -> list[Trajectory]:
        """:meth:`play_episodes` in the caller's event loop (one the engine lives in), e.g. for
        ``python -m lightning_agentrl evaluate``, which never starts the training loop. ``on_episode``, if
        given, is called with each trajectory as it ends (progress)."""
        slots = asyncio.Semaphore(self.plan.max_in_flight)
        client = self.make_client()

        async def play(index: int, task: Task, sample: int) -> Trajectory:
            async with slots:
                trajectory = await self.play(
                    engine=self.engine, env=self.make_env(client, task), codec=self.codec, sampling=sampling,
                    budget=self.budget, episode_id=f"{tag}-{task.id}-{sample}", task_id=task.id, group_id=index,
                )
            if on_episode is not None:
                on_episode(trajectory)
            return trajectory

        try:
            return await asyncio.gather(
                *(play(index, task, sample) for index, task in enumerate(tasks) for sample in range(samples_per_task))
            )
        finally:
            if client is not None:  # None: the environment uses no sandbox service
                await client.close()

    # -- resume ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Task position, ready groups, and the progress of started groups (finished and parked
        episodes); episodes that were running restart from scratch on resume."""
        loop = self._loop
        if loop is not None and loop.is_running() and self._thread is not None:
            # Snapshot on the loop's thread: episodes park and finish there.
            return asyncio.run_coroutine_threadsafe(self._snapshot(), loop).result()
        return self._state()

    async def _snapshot(self) -> dict:
        return self._state()

    def _state(self) -> dict:
        return {
            "next_group": self._next_group,
            "restart": sorted(self._pending | set(self._restart)),
            "groups": {
                str(group_id): {
                    "finished": {str(i): t.model_dump(mode="json") for i, t in p.finished.items()},
                    "parked": {str(i): e.state.state_dict() for i, e in p.parked.items()},
                }
                for group_id, p in self._progress.items()
            },
            "buffer": self.buffer.state_dict(),
            "num_episodes_finished": self.num_episodes_finished,
            "num_skipped_steps": self.num_skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        assert self._thread is None, "load state before start()"
        self._next_group = state["next_group"]
        self._restart = list(state["restart"])
        self._progress = {
            int(group_id): _GroupProgress(
                finished={int(i): Trajectory.model_validate(t) for i, t in p["finished"].items()},
                parked={int(i): ParkedEpisode(EpisodeState.from_state_dict(e)) for i, e in p["parked"].items()},
            )
            for group_id, p in state.get("groups", {}).items()
        }
        self.buffer.load_state_dict(state["buffer"])
        self.num_episodes_finished = state["num_episodes_finished"]
        self.num_skipped_steps = state.get("num_skipped_steps", 0)  # absent in older checkpoints


class LoopWatchdog(threading.Thread):
    """Watches the service's event loop from a thread of its own: an environment's ``async def`` that blocks
    (``time.sleep``, a synchronous HTTP client) stops every episode, and no episode timeout can fire on a
    blocked loop. When the loop has not run for ``stall_s`` (``env.episode_timeout_s``) inside an
    environment's method, ``fail`` gets an error naming it (the run stops instead of hanging without a
    word); a stall elsewhere is logged once. It ends with the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, watched: threading.Thread, stall_s: float, fail,
                 *, interval_s: float = 1.0) -> None:
        super().__init__(name="rollout-watchdog", daemon=True)
        self.loop, self.watched, self.stall_s, self.fail, self.interval_s = loop, watched, stall_s, fail, interval_s
        self.last_beat = time.monotonic()
        self.blocked_by: str | None = None  # the environment method that blocked the loop, once it did

    def _beat(self) -> None:
        self.last_beat = time.monotonic()

    def run(self) -> None:
        warned = False
        while self.watched.is_alive():
            try:
                self.loop.call_soon_threadsafe(self._beat)
            except RuntimeError:  # the loop closed
                return
            time.sleep(self.interval_s)
            stalled = time.monotonic() - self.last_beat
            if stalled < self.stall_s:
                warned = False
                continue
            frame = sys._current_frames().get(self.watched.ident)
            where, stack = _env_frame(frame), "".join(traceback.format_stack(frame)) if frame else ""
            if where is not None:
                message = (f"{where} has blocked the rollout's event loop for {stalled:.0f} s (env.episode_timeout_s="
                           f"{self.stall_s:g}): an `async def` must not block; run blocking work with "
                           "`await asyncio.to_thread(...)`")
                log.error("%s\n%s", message, stack)
                self.blocked_by = where
                self.fail(RuntimeError(message))
                return
            if not warned:
                log.warning("the rollout's event loop has not run for %.0f s; it is in:\n%s", stalled, stack)
                warned = True


def _env_frame(frame) -> str | None:
    """``<Class>.<method> (file:line)`` of the innermost frame of an environment's method, or None."""
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Environment):
            code = frame.f_code
            return f"{type(owner).__qualname__}.{code.co_name} ({code.co_filename}:{frame.f_lineno})"
        frame = frame.f_back
    return None
