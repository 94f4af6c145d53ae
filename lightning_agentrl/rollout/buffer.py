"""Finished groups waiting for the trainer, with a staleness bound, resumable.

A *group* is the G episodes of one task. A group is ready when all G have ended. The buffer
hands out whole groups in the order they finished; a group whose oldest token lags the trainer's
policy version by more than ``max_staleness`` is dropped (and counted) when it is taken.
"""

from __future__ import annotations

import threading
from collections import deque

from lightning_agentrl.trajectory import Trajectory


class RolloutServiceError(RuntimeError):
    """The producer died (an engine or an episode raised); the cause is chained as ``__cause__``."""


class RolloutBuffer:
    def __init__(self, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self._ready: deque[list[Trajectory]] = deque()
        self._cond = threading.Condition()
        self.num_dropped_stale = 0
        self._closed_error: BaseException | None = None

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

    def take(
        self, num_groups: int, policy_version: int, timeout_s: float | None = None
    ) -> list[list[Trajectory]]:
        """Block until ``num_groups`` fresh groups are ready; drop stale ones on the way."""
        taken: list[list[Trajectory]] = []
        with self._cond:
            while len(taken) < num_groups:
                if self._closed_error is not None:
                    raise RolloutServiceError("the rollout service stopped") from self._closed_error
                if not self._ready:
                    if not self._cond.wait(timeout=timeout_s):
                        raise TimeoutError(f"no rollout group became ready within {timeout_s} s")
                    continue
                group = self._ready.popleft()
                oldest = min(
                    (t.min_policy_version for t in group if t.min_policy_version >= 0), default=policy_version
                )
                if policy_version - oldest > self.max_staleness:
                    self.num_dropped_stale += 1
                    continue
                taken.append(group)
        return taken

    def state_dict(self) -> dict:
        with self._cond:
            return {
                "ready": [[t.model_dump(mode="json") for t in group] for group in self._ready],
                "num_dropped_stale": self.num_dropped_stale,
            }

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self._ready = deque([Trajectory.model_validate(t) for t in group] for group in state["ready"])
            self.num_dropped_stale = state["num_dropped_stale"]
