"""Rooms: a graph of named rooms walked one exit per turn, for comparing credit-assignment methods.

``env.kind: lightning_agentrl.envs.rooms:RoomsEnv``. Each turn the agent sees the room it is in and
its exits, and answers with one direction (``north``). The episode ends at the goal (reward 1), at
an *exit room* (its own reward, e.g. a cheap shortcut worth 0.25), or at ``env.max_turns``. A
*bonus room* pays its reward once, on the first entry (per-turn rewards). Other rooms pay nothing.
A direction the room has no exit for is a wall (the turn is spent); an answer that is not a direction is an
error (``env.max_tool_errors`` in a row end the episode).

The worlds are built so that the reason a method exists is present (``benchmarks/rooms_worlds.py``
writes them and says which comparison uses which): the same room is reached by different paths and
dead ends waste turns (GiGPO's anchor states), a cheap exit lies near the start while the goal takes
more turns than a loose policy has (compact filtering), bonus rooms lie on the way (a turn-level
critic). With ``noise`` on, every observation ends with a clock, the turns spent so far (``clock 4``), as
a timestamp in a tool's output would: a room reached by different paths at different turns reads
differently, so GiGPO's exact anchor groups split it while its similarity mode
(``algorithm.gigpo_similarity``) merges it.

The goal is never named to the policy: the system prompt says "the vault" and entering the goal reads
"the vault.", whichever room it is (``maze_goals`` puts it in one of four corners, so only training knows
which). The critic is told (:attr:`RoomsEnv.critic_context`, read only with ``algorithm.privileged_critic``):
``the vault is quarry; a shortest way from nursery: jetty, kitchen, orchard, pantry, quarry``, in every
world (in the one-goal worlds it says what the policy can learn from the map). The rooms of the way, not the
goal's name alone: a room's value is how near the goal it is, and a room named in the context is one the
value head can match, by attention, against the room the last observation names (a copy, which even the tiny
model learns), where the name alone would need the map's distances learned into the trunk.

Tasks are JSONL, one start a line, the world inline::

    {"id": "maze_03", "split": "train", "start": "attic", "goal": "vault",
     "rooms": {"attic": {"east": "hall"}, "hall": {"west": "attic", "north": "vault"}, "vault": {}},
     "exit_rooms": {}, "bonus_rooms": {}, "noise": false}
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from lightning_agentrl.envs.base import Environment, StepResult, load_jsonl_tasks

GOAL_REWARD = 1.0
DIRECTIONS = ("north", "south", "east", "west")
SYSTEM_PROMPT = "Walk the rooms to the vault. Answer with one exit: north, south, east or west."


@dataclass(frozen=True)
class RoomsTask:
    id: str
    start: str
    goal: str
    rooms: dict[str, dict[str, str]]
    split: str = "train"
    exit_rooms: dict[str, float] = field(default_factory=dict)
    bonus_rooms: dict[str, float] = field(default_factory=dict)
    noise: bool = False


def parse_task(data: dict, where: str) -> RoomsTask:
    """A task from one JSONL line; ``ValueError`` naming ``where`` and the problem."""
    try:
        task = RoomsTask(**data)
    except TypeError as err:
        raise ValueError(f"{where}: {err}") from None
    rooms = task.rooms
    if not isinstance(task.id, str) or not task.id:
        raise ValueError(f"{where}: id must be a non-empty string, got {task.id!r}")
    if not isinstance(rooms, dict) or not all(isinstance(r, str) and isinstance(e, dict) for r, e in rooms.items()):
        raise ValueError(f"{where}: rooms must map room names to their exits ({{direction: room}})")
    if task.start not in rooms or task.goal not in rooms or task.start == task.goal:
        raise ValueError(f"{where}: start and goal must be two different rooms")
    for room, exits in rooms.items():
        bad = {d: r for d, r in exits.items() if d not in DIRECTIONS or not isinstance(r, str) or r not in rooms}
        if bad:
            raise ValueError(f"{where}: room {room!r} has exits to unknown directions or rooms: {bad}")
    for name, table in (("exit_rooms", task.exit_rooms), ("bonus_rooms", task.bonus_rooms)):
        if not isinstance(table, dict) or set(table) - set(rooms):
            raise ValueError(f"{where}: {name} must map rooms of the world to rewards")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in table.values()):
            raise ValueError(f"{where}: {name} rewards must be finite numbers, got {table}")
    if task.start in task.exit_rooms or task.goal in task.exit_rooms:
        raise ValueError(f"{where}: the start and the goal cannot be exit rooms")
    if not isinstance(task.noise, bool):
        raise ValueError(f"{where}: noise must be true or false, got {task.noise!r}")
    if task.split not in ("train", "test"):
        raise ValueError(f"{where}: split must be train or test, got {task.split!r}")
    if shortest_path(task) is None:
        raise ValueError(f"{where}: the goal cannot be reached from {task.start!r}")
    return task


def load_rooms_tasks(path: str | Path, *, split: str | None = None) -> list[RoomsTask]:
    """The tasks in a JSONL file, or in every ``*.jsonl`` of a folder, sorted by id."""
    return load_jsonl_tasks(path, parse_task, split=split, what="rooms")


def shortest_path(task: RoomsTask, rng: random.Random | None = None) -> list[str] | None:
    """A shortest list of directions from the start to the goal (not through exit rooms); None if none.
    Breadth-first with one back-pointer per room (memory linear in the rooms); ``rng`` shuffles the order
    exits are tried in, which picks one of several shortest paths."""
    came_from: dict[str, tuple[str, str] | None] = {task.start: None}
    queue = deque([task.start])
    while queue:
        room = queue.popleft()
        if room == task.goal:
            path = []
            while came_from[room] is not None:
                room, direction = came_from[room]
                path.append(direction)
            return path[::-1]
        if room in task.exit_rooms:
            continue
        exits = list(task.rooms[room].items())
        if rng is not None:
            rng.shuffle(exits)
        for direction, following in exits:
            if following not in came_from:
                came_from[following] = (room, direction)
                queue.append(following)
    return None


def critic_text(task: RoomsTask) -> str:
    """What only the critic reads of ``task``: the goal and the rooms of a shortest way to it from the start.

    >>> critic_text(RoomsTask(id="t", start="a", goal="c", rooms={"a": {"east": "b"}, "b": {"east": "c"}, "c": {}}))
    'the vault is c; a shortest way from a: b, c'
    """
    room, way = task.start, []
    for direction in shortest_path(task):
        room = task.rooms[room][direction]
        way.append(room)
    return f"the vault is {task.goal}; a shortest way from {task.start}: {', '.join(way)}"


class RoomsEnv(Environment):
    """One episode in a rooms world."""

    @classmethod
    def load_tasks(cls, path, *, split):
        return load_rooms_tasks(path, split=split)

    def __init__(self, task: RoomsTask) -> None:
        self.task = task
        self.room = task.start
        self.visited = {task.start}
        self.clock = 0  # turns spent: the noise of ``noise`` worlds
        self._view = self._describe()
        self.critic_context = critic_text(task)  # the goal, for a privileged critic only (module docstring)

    async def reset(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self._view}]

    def _describe(self) -> str:
        exits = ", ".join(d for d in DIRECTIONS if d in self.task.rooms[self.room])
        text = f"{self.room}. exits: {exits or 'none'}"
        return f"{text}. clock {self.clock}" if self.task.noise else text

    @property
    def state_text(self) -> str:
        """What the agent sees of its state: the room, its exits and (with ``noise``) the clock."""
        return self._view

    async def step(self, action_text: str) -> StepResult:
        direction = action_text.strip().strip(".").lower()
        self.clock += 1
        exits = self.task.rooms[self.room]
        if direction not in exits:  # a wall (the turn is spent) or not a direction (an error)
            self._view = self._describe()
            if direction in DIRECTIONS:
                return StepResult(f"a wall. {self._view}", info={"tool": "move", "error": False})
            return StepResult(f"not a direction: {direction[:20]!r}. {self._view}", info={"tool": "move", "error": True})
        self.room = exits[direction]
        first_entry = self.room not in self.visited
        self.visited.add(self.room)
        if self.room == self.task.goal:
            return StepResult("the vault.", reward=GOAL_REWARD, done=True, info={"tool": "move", "submitted": True})
        if self.room in self.task.exit_rooms:
            reward = self.task.exit_rooms[self.room]
            return StepResult(f"{self.room}: the way out.", reward=reward, done=True, info={"tool": "move", "submitted": True})
        reward = self.task.bonus_rooms.get(self.room, 0.0) if first_entry else 0.0
        self._view = self._describe()
        return StepResult(self._view, reward=reward, info={"tool": "move", "error": False})

    def demonstration(self, rng) -> list[str]:
        """A shortest path to the goal (:func:`shortest_path`), one bare direction per turn."""
        return shortest_path(self.task, rng)

    def state_dict(self) -> dict:
        return {"room": self.room, "visited": sorted(self.visited), "clock": self.clock}

    def load_state_dict(self, state: dict) -> None:
        self.room, self.visited, self.clock = state["room"], set(state["visited"]), state["clock"]
        self._view = self._describe()


class RoomsEnvNoCriticContext(RoomsEnv):
    """:class:`RoomsEnv` whose critic is told nothing (``critic_context`` None): the control of a privileged
    critic. With ``algorithm.privileged_critic`` the value head then reads the policy's own stream through the
    same second forward, without gradients into the trunk, so against :class:`RoomsEnv` the only difference is
    the goal (against a plain critic, the trunk the value loss no longer trains)."""

    def __init__(self, task: RoomsTask) -> None:
        super().__init__(task)
        self.critic_context = None
