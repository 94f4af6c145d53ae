"""The rooms worlds of the credit-assignment comparisons (``lightning_agentrl.envs.rooms``): the shipped
worlds have the property each comparison relies on, the environment pays what its docstring says, and
GiGPO's similarity mode merges a room reached at different turns through ``fit``."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml

from benchmarks.compare import COMPARISONS, summarize
from benchmarks.rooms_worlds import random_walk_success
from lightning_agentrl.algorithms.advantages import lcs_similarity
from lightning_agentrl.envs.rooms import RoomsEnv, load_rooms_tasks, parse_task, shortest_path
from lightning_agentrl.trajectory import TerminationReason
from tests.fitting import REPO, learn_settings, scripted_fit

pytestmark = pytest.mark.timeout(300)
WORLDS = REPO / "tasks" / "rooms"
LINE = {"id": "line", "start": "a", "goal": "g", "noise": True,
        "rooms": {"a": {"east": "b"}, "b": {"west": "a", "east": "c"}, "c": {"west": "b", "east": "g"}, "g": {}}}


def play(task, actions):
    async def go():
        env = RoomsEnv(task)
        await env.reset()
        return env, [await env.step(a) for a in actions]

    return asyncio.run(go())


@pytest.mark.parametrize("world", ["maze", "maze_noise", "maze_bonus", "shortcut"])
def test_every_shipped_world_has_both_splits_and_a_reachable_goal_in_its_recipe_budget(world):
    tasks = load_rooms_tasks(WORLDS / f"{world}.jsonl")
    assert {t.split for t in tasks} == {"train", "test"}
    recipe = "credit_truncation" if world == "shortcut" else "credit_gigpo"
    max_turns = yaml.safe_load((REPO / "configs" / f"{recipe}.yaml").read_text())["env"]["max_turns"]
    assert max(len(shortest_path(t)) for t in tasks) <= max_turns
    assert all(random_walk_success(t, max_turns, episodes=500) > 0 for t in tasks if t.split == "train")


def test_the_shortcut_world_puts_a_cheap_exit_nearer_than_the_goal():
    for task in load_rooms_tasks(WORLDS / "shortcut.jsonl"):
        to_porch = shortest_path(parse_task({**task.__dict__, "goal": "porch", "exit_rooms": {}}, "probe"))
        assert len(to_porch) < len(shortest_path(task)), task.id
        assert task.exit_rooms == {"porch": 0.25}


def test_the_similarity_threshold_merges_a_room_at_any_clock_and_never_two_rooms():
    """compare.py's similarity arm: every view of one room (clock 0 .. max_turns) is above the threshold,
    every pair of different rooms below it."""
    threshold = float(COMPARISONS["rooms_similarity"]["arms"]["gigpo similarity"][1].split("=")[1])
    task = load_rooms_tasks(WORLDS / "maze_noise.jsonl")[0]
    views = {}
    for room in task.rooms:
        env = RoomsEnv(task)
        env.load_state_dict({"room": room, "visited": [room], "clock": 0})
        views[room] = [env.state_text]
        for clock in range(1, 11):  # the clock runs to max_turns (10 in the recipe)
            env.load_state_dict({"room": room, "visited": [room], "clock": clock})
            views[room].append(env.state_text)
    assert views["attic"][10] == "attic. exits: east. clock 10"
    same = min(lcs_similarity(a, b) for v in views.values() for a in v for b in v)
    different = max(lcs_similarity(a, b) for r in views for s in views if r != s for a in views[r] for b in views[s])
    assert different < threshold < same


def test_walls_errors_bonus_and_exit_rooms_pay_what_the_docstring_says():
    rooms = {**LINE["rooms"], "b": {**LINE["rooms"]["b"], "south": "d"}, "d": {"north": "b"}}
    task = parse_task({**LINE, "rooms": rooms, "noise": False, "bonus_rooms": {"b": 0.2}, "exit_rooms": {"d": 0.25}}, "t")
    env, results = play(task, ["north", "jump", "east", "west", "east", "south"])
    assert [(r.reward, r.done, r.info["error"] if "error" in r.info else None) for r in results] == [
        (0.0, False, False), (0.0, False, True), (0.2, False, False), (0.0, False, False), (0.0, False, False),
        (0.25, True, None)]
    assert results[0].observation == "a wall. a. exits: east"
    _, to_goal = play(parse_task({**LINE, "noise": False}, "t"), ["east", "east", "east"])
    assert [r.reward for r in to_goal] == [0.0, 0.0, 1.0] and to_goal[-1].done


def test_noise_is_the_clock_and_a_parked_episode_resumes_with_it():
    env, results = play(parse_task(LINE, "t"), ["east", "west", "east"])
    assert results[-1].observation == "b. exits: east, west. clock 3"
    resumed = RoomsEnv(parse_task(LINE, "t"))
    resumed.load_state_dict(json.loads(json.dumps(env.state_dict())))
    assert resumed.state_text == env.state_text


@pytest.mark.parametrize("line, problem", [
    ({**LINE, "goal": "z"}, "start and goal must be two different rooms"),
    ({**LINE, "goal": "a"}, "start and goal must be two different rooms"),
    ({**LINE, "rooms": [["a"]]}, "rooms must map room names"),
    ({**LINE, "exit_rooms": {"b": float("nan")}}, "rewards must be finite"),
    ({**LINE, "bonus_rooms": {"b": True}}, "rewards must be finite"),
    ({**LINE, "exit_rooms": {"g": 1.0}}, "cannot be exit rooms"),
    ({**LINE, "id": 7}, "id must be a non-empty string"),
    ({**LINE, "noise": "yes"}, "noise must be true or false"),
    ({**LINE, "rooms": {**LINE["rooms"], "a": {"up": "b"}}}, "unknown directions or rooms"),
    ({**LINE, "rooms": {**LINE["rooms"], "c": {"west": "b"}}}, "cannot be reached"),
    ({**LINE, "colour": "red"}, "colour"),
])
def test_a_malformed_task_is_refused_naming_the_line(line, problem):
    with pytest.raises(ValueError, match="tasks.jsonl:2") as err:
        parse_task(line, "tasks.jsonl:2")
    assert problem in str(err.value)


def test_gigpo_similarity_merges_a_room_reached_at_different_turns_through_fit(tmp_path):
    """Per group, episode 0 walks a b a b (rooms at clocks 0 1 2 3), episode 1 walks a b c g: 8 turns,
    rooms a a b b (e0) and a b c (e1), each at its own clock except the two episodes' first two turns.
    Exact anchors: a@0, b@1, a@2, b@3, c@2 = 5 per group; similarity mode: a, b, c = 3 per group."""
    tasks = tmp_path / "line.jsonl"
    tasks.write_text("".join(json.dumps({**LINE, "id": f"l{i}"}) + "\n" for i in range(2)))
    counts = {}
    for mode in ([], ["--algorithm.gigpo_similarity=0.95"]):
        settings = learn_settings(tmp_path / str(len(mode)), "--env.kind=lightning_agentrl.envs.rooms:RoomsEnv",
                                  f"--env.tasks={tasks}", "--env.max_turns=4", "--algorithm.advantage=gigpo",
                                  "--trainer.max_steps=1", *mode)
        _, log = scripted_fit(settings, {"e0": ["east", "west", "east", "west"], "e1": ["east", "east", "east"]})
        (batch,), (step,) = log.batches, log.metrics
        counts[bool(mode)] = step["gigpo/num_anchor_groups"]
        ends = sorted((t.episode_id[-2:], t.termination, t.reward) for t in batch.trajectories)
        assert ends == [("e0", TerminationReason.MAX_TURNS, 0.0)] * 2 + [("e1", TerminationReason.SUBMITTED, 1.0)] * 2
    assert counts == {False: 10.0, True: 6.0}


def test_summarize_pairs_arms_by_seed_and_leaves_the_std_of_one_seed_unknown():
    def run(arm, seed, final):
        return {"arm": arm, "seed": seed, "final": final, "train_truncation_rate": 0.0, "seconds": 1.0,
                "first_at_target": None, "curve": [{"step": 0, "score": 0.1, "minutes": 0.5}, {"step": 9, "score": final, "minutes": 9.0}],
                "late_endings": {"submitted@1": 2}, "late_turns": {"submitted@1": {"3": 1, "5": 1}}}

    spec = {"arms": {"a": [], "b": [], "c": []}, "pairs": [("a", "b"), ("b", "c")]}
    summary = summarize(spec, [run("a", 0, 0.2), run("b", 0, 0.5), run("a", 1, 0.4), run("b", 1, 0.5),
                               run("c", 1, 0.3)])
    assert summary["pairs"]["b - a"]["per_seed"] == pytest.approx([0.3, 0.1])
    assert summary["pairs"]["b - a"]["mean"] == pytest.approx(0.2) and summary["pairs"]["b - a"]["wins"] == 2
    assert summary["pairs"]["c - b"] == {"per_seed": [pytest.approx(-0.2)], "wins": 0, "mean": pytest.approx(-0.2),
                                         "std": None}  # only seed 1 ran both
    assert summary["arms"]["a"]["per_step"][1] == {"step": 9, "mean": pytest.approx(0.3), "std": pytest.approx(0.1414, abs=1e-4)}
    assert summary["arms"]["c"]["final_std"] is None
    assert summary["arms"]["b"]["reached_target"] == "2/2" and summary["arms"]["b"]["minutes_to_target"] == [9.0, 9.0]
    assert summary["arms"]["a"]["reached_target"] == "0/2"
    assert summary["arms"]["a"]["late_endings"] == {"submitted@1": 4} and summary["arms"]["a"]["late_mean_turns"] == {"submitted@1": 4.0}
