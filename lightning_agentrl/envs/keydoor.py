"""Key and door: a small text maze, fast on CPU, for the learning algorithms (``env.kind: keydoor``).

The agent walks a grid one square per turn (tool ``move``, a direction) to the goal ``G``. Lowercase
letters are keys, picked up by walking onto them; an uppercase door opens when the agent walks into
it holding the key of the same letter, and stays open. Maps have dead ends, and keys often lie in
them, so the same state (square, keys held, doors open) is reached by different paths: the state
text is that state and nothing else (not the path, not the turn), so GiGPO's anchor groups merge
them. Turns differ in value: a new key earns :data:`KEY_REWARD`, a door opened :data:`DOOR_REWARD`,
and reaching the goal ends the episode with reward 1 (the episode's reward).

Tasks are JSONL, one map a line (``tasks/keydoor/tasks.jsonl``; ``env.tasks`` is the file or a folder
of ``*.jsonl`` files)::

    {"id": "kd_000", "split": "train", "map": ["#######",
                                                "#S..#G#",
                                                "#.#.A.#",
                                                "#a#.#.#",
                                                "#######"]}

``S`` is the start, ``#`` a wall, ``.`` floor; the border must be walls. :func:`solve` finds a
shortest solution (every shipped map has one).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_agentrl.envs.base import Environment, StepResult, load_jsonl_tasks, step_each
from lightning_agentrl.envs.tools import ToolCallError, ToolSpec, parse_tool_calls

if TYPE_CHECKING:
    from lightning_agentrl.settings import EnvSettings

KEY_REWARD = 0.2
DOOR_REWARD = 0.2
GOAL_REWARD = 1.0
MOVES = {"north": (-1, 0), "south": (1, 0), "east": (0, 1), "west": (0, -1)}
KEYDOOR_TOOLS = (
    ToolSpec("move", "walk one square", {"direction": "north, south, east or west"}, {"direction": "north"}),
)
SYSTEM_PROMPT = """You walk a maze to its goal G. You are @, # is a wall, lowercase letters are keys (walk onto \
them to pick them up), an uppercase letter is a door that opens when you walk into it holding its lowercase key.
Reply with a short thought and exactly one tool call.
Tools:
{tools}"""
TASK_KEYS = frozenset({"id", "map", "split"})


@dataclass(frozen=True)
class KeyDoorTask:
    id: str
    map: tuple[str, ...]
    split: str = "train"

    def find(self, glyph: str) -> tuple[int, int]:
        return next((r, c) for r, row in enumerate(self.map) for c, g in enumerate(row) if g == glyph)


def parse_task(data: dict, where: str) -> KeyDoorTask:
    """A task from one JSONL line; ``ValueError`` naming ``where`` and the problem."""
    if not isinstance(data, dict) or not {"id", "map"} <= data.keys() or data.keys() - TASK_KEYS:
        raise ValueError(f"{where}: a task is an object with keys id, map and optionally split")
    rows = data["map"]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, str) and len(r) == len(rows[0]) for r in rows):
        raise ValueError(f"{where}: map must be a list of equally long strings")
    text = "".join(rows)
    if text.count("S") != 1 or text.count("G") != 1:
        raise ValueError(f"{where}: a map has exactly one S (start) and one G (goal)")
    if set(rows[0] + rows[-1] + "".join(r[0] + r[-1] for r in rows)) != {"#"}:
        raise ValueError(f"{where}: the map's border must be walls (#)")
    unknown = set(text) - set("#.SG") - {chr(c) for c in range(ord("a"), ord("z") + 1)}
    unknown -= {chr(c) for c in range(ord("A"), ord("Z") + 1)}
    if unknown:
        raise ValueError(f"{where}: unknown map glyphs {sorted(unknown)}")
    split = data.get("split", "train")
    if split not in ("train", "test"):
        raise ValueError(f"{where}: split must be train or test, got {split!r}")
    task_id = data["id"]
    if isinstance(task_id, bool) or not isinstance(task_id, str | int) or task_id == "":
        raise ValueError(f"{where}: id must be a non-empty string, got {task_id!r}")
    return KeyDoorTask(str(task_id), tuple(rows), split)


def load_keydoor_tasks(path: str | Path, *, split: str | None = None) -> list[KeyDoorTask]:
    """The tasks in a JSONL file, or in every ``*.jsonl`` of a folder, sorted by id."""
    return load_jsonl_tasks(path, parse_task, split=split, what="keydoor")


class KeyDoorEnv(Environment):
    """One episode in a key-and-door maze."""

    @classmethod
    def load_tasks(cls, path, *, split):
        return load_keydoor_tasks(path, split=split)

    @classmethod
    def from_settings(cls, task, *, client, settings: EnvSettings, native_tools: bool) -> KeyDoorEnv:
        return cls(task, native_tools=native_tools)

    def __init__(self, task: KeyDoorTask, *, native_tools: bool = False) -> None:
        self.task = task
        self.tools = [tool.schema() for tool in KEYDOOR_TOOLS] if native_tools else None
        self.position = task.find("S")
        self.keys: set[str] = set()
        self.opened: set[str] = set()

    async def reset(self) -> list[dict]:
        tools = "move, as defined for this conversation." if self.tools else KEYDOOR_TOOLS[0].render()
        return [{"role": "system", "content": SYSTEM_PROMPT.replace("{tools}", tools)},
                {"role": "user", "content": f"Reach G.\n{self.view}"}]

    @property
    def state_text(self) -> str:
        """The state and nothing else: the agent's square, the keys held, the doors opened (``at 1,3 keys: a
        open: none``). Short on purpose: in similarity mode (``algorithm.gigpo_similarity``) two states that
        differ by one square differ by a character in ~25, where the whole map's text would differ by one
        character in hundreds and merge different states."""
        (r, c), keys, opened = self.position, "".join(sorted(self.keys)), "".join(sorted(self.opened))
        return f"at {r},{c} keys: {keys or 'none'} open: {opened or 'none'}"

    @property
    def view(self) -> str:
        """The map as the agent sees it (``@``, keys left, doors still closed) and the keys held: what the
        observations show."""
        rows = []
        for r, row in enumerate(self.task.map):
            glyphs = [self._glyph(g) for g in row]
            if r == self.position[0]:
                glyphs[self.position[1]] = "@"
            rows.append("".join(glyphs))
        return "\n".join(rows) + f"\nkeys: {''.join(sorted(self.keys)) or 'none'}"

    def _glyph(self, glyph: str) -> str:
        taken = glyph.islower() and glyph in self.keys
        opened = glyph.isupper() and glyph not in "SG" and glyph.lower() in self.opened
        return "." if glyph == "S" or taken or opened else glyph

    async def step(self, action_text: str) -> StepResult:
        try:
            calls = parse_tool_calls(action_text, KEYDOOR_TOOLS, self.call_format)
        except ToolCallError as err:
            return StepResult(f"error: {err}", info={"tool": None, "error": True})
        return await step_each(calls, self._call, self.max_calls_per_turn)

    async def _call(self, call) -> StepResult:
        direction = call.arguments["direction"].strip().lower()
        if direction not in MOVES:
            return StepResult(f"error: direction must be one of {', '.join(MOVES)}", info={"tool": "move", "error": True})
        text, reward, done = self._move(MOVES[direction])
        info = {"tool": "move", "error": False, **({"submitted": True} if done else {})}
        observation = text if done else f"{text}\n{self.view}"
        return StepResult(observation, reward=reward, done=done, info=info)

    def _move(self, delta: tuple[int, int]) -> tuple[str, float, bool]:
        r, c = self.position[0] + delta[0], self.position[1] + delta[1]
        glyph = self._glyph(self.task.map[r][c])
        if glyph == "#":
            return "A wall blocks the way.", 0.0, False
        reward, text = 0.0, "You moved."
        if glyph.isupper() and glyph != "G":
            if glyph.lower() not in self.keys:
                return f"The door {glyph} is locked; it opens with key {glyph.lower()}.", 0.0, False
            self.opened.add(glyph.lower())
            reward, text = DOOR_REWARD, f"You opened door {glyph}."
        self.position = (r, c)
        if glyph == "G":
            return "You reached the goal.", GOAL_REWARD, True
        if glyph.islower():
            self.keys.add(glyph)
            reward, text = KEY_REWARD, f"You picked up key {glyph}."
        return text, reward, False

    def demonstration(self, rng) -> list[str] | None:
        """A shortest walk to the goal (:func:`solve`, moves tried in an order ``rng`` draws) as move calls; None
        for a map without one."""
        walk = solve(self.task, rng)
        return None if walk is None else [KEYDOOR_TOOLS[0].call(direction=direction) for direction in walk]

    def state_dict(self) -> dict:
        return {"position": list(self.position), "keys": sorted(self.keys), "opened": sorted(self.opened)}

    def load_state_dict(self, state: dict) -> None:
        self.position = tuple(state["position"])
        self.keys, self.opened = set(state["keys"]), set(state["opened"])


def solve(task: KeyDoorTask, rng: random.Random | None = None) -> list[str] | None:
    """A shortest list of directions from S to G (breadth-first over square, keys and doors); None if none.
    ``rng`` shuffles the order moves are tried in, which picks one of several shortest walks."""
    moves = list(MOVES.items())
    if rng is not None:
        rng.shuffle(moves)
    env = KeyDoorEnv(task)
    start = (env.position, frozenset(), frozenset())
    paths: dict[tuple, list[str]] = {start: []}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for direction, delta in moves:
            env.load_state_dict({"position": state[0], "keys": state[1], "opened": state[2]})
            _, _, done = env._move(delta)
            if done:
                return [*paths[state], direction]
            following = (env.position, frozenset(env.keys), frozenset(env.opened))
            if following not in paths:
                paths[following] = [*paths[state], direction]
                queue.append(following)
    return None
