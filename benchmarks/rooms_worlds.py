"""Write the rooms worlds of the credit-assignment comparisons (``tasks/rooms/*.jsonl``).

    python benchmarks/rooms_worlds.py            # rewrites tasks/rooms/ (deterministic) and prints each
                                                 # world's random-walk success over the listed exits

Each world is built so that the reason a method exists is present (lightning_agentrl/envs/rooms.py):

- ``maze``: 16 rooms on a 4 x 4 grid, a random spanning tree plus extra doors (loops), so a room is
  reached by different paths and dead ends waste turns; the goal in a corner; one task per start room,
  10 starts to train on and 5 held out. GiGPO vs GRPO, staleness weighting.
- ``maze_noise``: the same maze where every observation ends with a clock (the turns spent): a room
  reached at different turns reads differently (GiGPO's similarity mode vs exact anchors).
- ``maze_bonus``: the same maze where the rooms on each start's own shortest way to the goal pay 0.1
  on the first entry (at most 0.7 in all, below the goal's 1, so the best walk is still the shortest
  way): per-turn rewards (a turn-level critic, GAE, vs GRPO, which sees only the episode's final reward).
- ``maze_goals``: the same maze, where the goal is one of its four corners (attic, dungeon, nursery, quarry)
  and nothing the policy sees says which: the system prompt names only "the vault", and the goal reads "the
  vault." when it is entered, whichever corner it is. Each of the 12 other rooms is the start of four tasks,
  one per corner, so a start does not tell its goal and the policy's best walk is a search of the corners;
  9 starts (36 tasks) to train on and 3 held out (12 tasks), each with all four goals. Held-out starts, not
  held-out (start, goal) pairs: training from a start without one of its corners would teach the policy to
  avoid that corner, which the held-out pair then needs. The value of a room depends on what only training
  knows (the goal): a privileged critic that reads it (``RoomsEnv.critic_context``,
  ``algorithm.privileged_critic``) vs one that does not.
- ``shortcut``: a corridor world where a cheap exit (reward 0.25) lies one or two turns from every
  start and the goal (reward 1) three to five, with a turn budget that a loose policy overruns:
  truncation cuts long, correct work (compact filtering vs reward 0).

"Held out" means held-out start rooms: every world is one map, and the held-out starts are rooms that
training episodes also walk through (14% of the training turns of a maze run are taken in them). The
held-out score says how well the policy trained on other starts finds the goal from these; it is not a
test on unseen rooms.

The random-walk success printed per task is what a uniform choice among the listed exits would reach;
the warm-started policy spreads only about 0.7 of its probability over the listed exits (it knows the
answer format better than the map), so measured baselines (``baseline`` in the records) are lower.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightning_agentrl.envs.rooms import DIRECTIONS, RoomsTask, parse_task, shortest_path  # noqa: E402

NAMES = ["attic", "bakery", "cellar", "dungeon", "forge", "gallery", "harbor", "igloo",
         "jetty", "kitchen", "library", "mill", "nursery", "orchard", "pantry", "quarry"]
CORNERS = ["attic", "dungeon", "nursery", "quarry"]  # maze_goals' goals: the corners of the 4 x 4 grid
BONUS = 0.1  # per room on the way in maze_bonus: at most 0.7 in all (7 rooms on the longest way), below the goal's 1
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
STEP = {"north": (-1, 0), "south": (1, 0), "east": (0, 1), "west": (0, -1)}


def grid_maze(size: int = 4, extra_doors: int = 3, seed: int = 7) -> dict[str, dict[str, str]]:
    """A random spanning tree of the size x size grid (depth-first, so it has dead ends) plus
    ``extra_doors`` doors between neighbours (loops: a room reached by two paths)."""
    rng = random.Random(seed)
    name = {(r, c): NAMES[r * size + c] for r in range(size) for c in range(size)}
    rooms: dict[str, dict[str, str]] = {n: {} for n in name.values()}

    def connect(a, b, direction):
        rooms[name[a]][direction] = name[b]
        rooms[name[b]][OPPOSITE[direction]] = name[a]

    def neighbours(cell):
        for direction, (dr, dc) in STEP.items():
            other = (cell[0] + dr, cell[1] + dc)
            if other in name:
                yield direction, other

    seen, stack = {(0, 0)}, [(0, 0)]
    while stack:
        cell = stack[-1]
        options = [(d, o) for d, o in neighbours(cell) if o not in seen]
        if not options:
            stack.pop()
            continue
        direction, other = rng.choice(options)
        connect(cell, other, direction)
        seen.add(other)
        stack.append(other)
    walls = [(cell, d, o) for cell in name for d, o in neighbours(cell) if name[o] not in rooms[name[cell]].values()]
    for cell, direction, other in rng.sample(walls, extra_doors):
        connect(cell, other, direction)
    return {room: dict(sorted(exits.items(), key=lambda kv: DIRECTIONS.index(kv[0]))) for room, exits in rooms.items()}


def random_walk_success(task: RoomsTask, max_turns: int, episodes: int = 4000, seed: int = 0) -> float:
    """Share of uniformly random walks (over the room's exits) that reach the goal in ``max_turns``."""
    rng, wins = random.Random(seed), 0.0
    for _ in range(episodes):
        room = task.start
        for _ in range(max_turns):
            room = task.rooms[room][rng.choice(list(task.rooms[room]))]
            if room == task.goal or room in task.exit_rooms:
                wins += room == task.goal
                break
    return wins / episodes


def maze_tasks(kind: str) -> list[dict]:
    rooms = grid_maze()
    goal = NAMES[-1]
    starts = [n for n in NAMES if n != goal]
    held_out = set(random.Random(1).sample(starts, 5))
    tasks = []
    for start in starts:
        bonus = {}
        if kind == "maze_bonus":  # the rooms on this start's own shortest way pay BONUS each, once
            room = start
            for direction in shortest_path(RoomsTask(id="probe", start=start, goal=goal, rooms=rooms))[:-1]:
                room = rooms[room][direction]
                bonus[room] = BONUS
        tasks.append({"id": f"{kind}_{start}", "split": "test" if start in held_out else "train", "start": start,
                      "goal": goal, "rooms": rooms, "bonus_rooms": bonus, "noise": kind == "maze_noise"})
    return tasks


def maze_goals_tasks() -> list[dict]:
    """``maze_goals``: every (start, corner) pair of the maze; three starts held out with all their goals."""
    rooms = grid_maze()
    starts = [n for n in NAMES if n not in CORNERS]
    held_out = set(random.Random(3).sample(starts, 3))
    return [{"id": f"maze_goals_{start}_to_{goal}", "split": "test" if start in held_out else "train",
             "start": start, "goal": goal, "rooms": rooms} for start in starts for goal in CORNERS]


def shortcut_tasks() -> list[dict]:
    """A corridor attic .. forge to the goal (vault, east of forge), a dead end (igloo, south of cellar), and
    a porch (the cheap exit, 0.25) west of attic and north of bakery. From attic the goal is 5 turns away
    and the porch 1; from bakery 4 and 1; from cellar 3 and 2."""
    corridor = ["attic", "bakery", "cellar", "dungeon", "forge"]
    rooms: dict[str, dict[str, str]] = {n: {} for n in [*corridor, "igloo", "porch", "vault"]}
    for a, b in zip(corridor, corridor[1:], strict=False):
        rooms[a]["east"], rooms[b]["west"] = b, a
    rooms["forge"]["east"], rooms["vault"]["west"] = "vault", "forge"
    rooms["attic"]["west"], rooms["porch"]["east"] = "porch", "attic"
    rooms["bakery"]["north"], rooms["porch"]["south"] = "porch", "bakery"
    rooms["cellar"]["south"], rooms["igloo"]["north"] = "igloo", "cellar"
    rooms = {room: dict(sorted(exits.items(), key=lambda kv: DIRECTIONS.index(kv[0]))) for room, exits in rooms.items()}
    held_out = {"bakery"}
    return [{"id": f"shortcut_{start}", "split": "test" if start in held_out else "train", "start": start,
             "goal": "vault", "rooms": rooms, "exit_rooms": {"porch": 0.25}}
            for start in ("attic", "bakery", "cellar")]


WORLDS = {"maze": lambda: maze_tasks("maze"), "maze_noise": lambda: maze_tasks("maze_noise"),
          "maze_bonus": lambda: maze_tasks("maze_bonus"), "shortcut": shortcut_tasks, "maze_goals": maze_goals_tasks}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "tasks" / "rooms", help="folder of the *.jsonl worlds")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    for world, build in WORLDS.items():
        lines = [json.dumps(task) for task in build()]
        for number, line in enumerate(lines, 1):
            parse_task(json.loads(line), f"{world}:{number}")
        (out / f"{world}.jsonl").write_text("\n".join(lines) + "\n")
        for turns in (6, 10):
            rates = [random_walk_success(parse_task(json.loads(line), world), turns) for line in lines]
            print(f"{world}: random-walk success in {turns} turns per task (over the listed exits) "
                  + " ".join(f"{r:.2f}" for r in rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
