"""Finished groups waiting for the trainer, with a staleness bound, resumable.

A *group* is the G episodes of one task. A group is ready when all G have ended. The buffer
hands out whole groups in the order they finished; a group whose oldest token lags the trainer's
policy version by more than ``max_staleness`` is dropped (and counted) when it is taken.

Dynamic sampling (DAPO): with ``dynamic_sampling`` a group whose episodes all earned the same
reward (no signal for a group baseline) is discarded (and counted) instead of trained, and the
take goes on until it holds enough groups with reward variance. One take looks at most at
``max_sampling_rounds`` batches' worth of groups; when that budget is spent it fills the batch with
the newest discarded groups (they train with zero advantage) and counts them as ``num_filled``.

Every dropped or discarded group was started by the rollout service and will never be trained,
so :attr:`num_removed` tells the service how many replacements it may start beyond its staleness
gate; ``on_change`` (called on the trainer's thread) wakes the service when that number grows or
when a take starts waiting.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from lightning_agentrl.trajectory import Trajectory


class RolloutServiceError(RuntimeError):
    """The producer died (an engine or an episode raised); the cause is chained as ``__cause__``."""


def has_reward_variance(group: list[Trajectory]) -> bool:
    """Not every episode of the group earned the same reward."""
    rewards = [t.reward for t in group]
    return max(rewards) > min(rewards)


class RolloutBuffer:
    def __init__(self, max_staleness: int, *, dynamic_sampling: bool = False, max_sampling_rounds: int = 1) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be >= 1, got {max_sampling_rounds}")
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self.max_sampling_rounds = max_sampling_rounds
        self._ready: deque[list[Trajectory]] = deque()
        self._cond = threading.Condition()
        self.num_dropped_stale = 0
        self.num_discarded = 0  # dynamic sampling: groups without reward variance, not trained
        self.num_filled = 0  # dynamic sampling: groups without variance trained because the budget ran out
        self.last_take: dict[str, int] = {"discarded": 0, "filled": 0}
        self.on_change: Callable[[], None] | None = None
        self._num_wanted = 0  # groups a waiting take still needs (0: no take waits)
        self._closed_error: BaseException | None = None

    @property
    def num_removed(self) -> int:
        """Groups that were started and will never be trained (dropped as stale or discarded)."""
        return self.num_dropped_stale + self.num_discarded

    @property
    def starved(self) -> bool:
        """A take waits, and the groups ready now are fewer than it still needs."""
        with self._cond:
            return self._num_wanted > 0 and len(self._ready) < self._num_wanted

    def put(self, group: list[Trajectory]) -> None:
        assert group and len({t.group_id for t in group}) == 1, "a group shares one group_id"
        with self._cond:
            self._ready.append(group)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Wake every waiter with the producer's error instead of letting it wait forever."""
        with self._cond:
            self._closed_error = error
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def take(
        self, num_groups: int, policy_version: int, timeout_s: float | None = None
    ) -> list[list[Trajectory]]:
        """Block until ``num_groups`` fresh groups are ready; drop stale ones (and, with dynamic
        sampling, discard those without reward variance) on the way. A take that times out or is
        woken by an error puts the groups it had taken back, in order, for the next take."""
        taken: list[list[Trajectory]] = []
        discarded: list[list[Trajectory]] = []
        num_filled = 0
        with self._cond:
            try:
                while len(taken) < num_groups:
                    if len(taken) + len(discarded) >= num_groups * self.max_sampling_rounds:
                        num_filled = num_groups - len(taken)  # budget spent: fill with the newest discarded
                        taken.extend(discarded[-num_filled:])
                        del discarded[-num_filled:]
                        self.num_discarded -= num_filled
                        self.num_filled += num_filled
                        break
                    self._next(taken, discarded, policy_version, timeout_s, num_groups - len(taken))
            except BaseException:
                self._ready.extendleft(reversed(taken))
                raise
        self.last_take = {"discarded": len(discarded), "filled": num_filled}
        return taken

    def _next(self, taken: list, discarded: list, policy_version: int, timeout_s: float | None, wanted: int) -> None:
        """Take one ready group into ``taken`` or ``discarded`` (or drop it), waiting if none is ready."""
        if self._closed_error is not None:
            raise RolloutServiceError("the rollout service stopped") from self._closed_error
        if not self._ready:
            self._num_wanted = wanted
            self._changed()
            try:
                if not self._cond.wait(timeout=timeout_s):
                    raise TimeoutError(f"no rollout group became ready within {timeout_s} s")
            finally:
                self._num_wanted = 0
            return
        group = self._ready.popleft()
        oldest = min((t.min_policy_version for t in group if t.min_policy_version >= 0), default=policy_version)
        if policy_version - oldest > self.max_staleness:
            self.num_dropped_stale += 1
            self._changed()
        elif self.dynamic_sampling and not has_reward_variance(group):
            discarded.append(group)
            self.num_discarded += 1
            self._changed()
        else:
            taken.append(group)

    def state_dict(self) -> dict:
        with self._cond:
            return {
                "ready": [[t.model_dump(mode="json") for t in group] for group in self._ready],
                "num_dropped_stale": self.num_dropped_stale,
                "num_discarded": self.num_discarded,
                "num_filled": self.num_filled,
            }

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self._ready = deque([Trajectory.model_validate(t) for t in group] for group in state["ready"])
            self.num_dropped_stale = state["num_dropped_stale"]
            self.num_discarded = state.get("num_discarded", 0)  # absent in older checkpoints
            self.num_filled = state.get("num_filled", 0)
