"""The hidden-goal maze of the privileged-critic comparison (``tasks/rooms/maze_goals.jsonl``,
``benchmarks/rooms_worlds.py``): the world has what its docstring claims, the policy is never told the goal,
and through ``fit`` the value head reads the goal (``RoomsEnv.critic_context``) with
``algorithm.privileged_critic``."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict

import pytest
import yaml

from benchmarks.compare import COMPARISONS
from benchmarks.rooms_worlds import CORNERS, random_walk_success
from lightning_agentrl.envs.rooms import RoomsEnv, critic_text, load_rooms_tasks, shortest_path
from tests.fitting import REPO, learn_settings, scripted_fit
from tests.test_fit_critic import ExpectedTurnValues

pytestmark = pytest.mark.timeout(300)
WORLD = REPO / "tasks" / "rooms" / "maze_goals.jsonl"
RECIPE = yaml.safe_load((REPO / "configs" / "credit_privileged.yaml").read_text())


def test_every_start_has_every_corner_as_its_goal_and_whole_starts_are_held_out():
    tasks = load_rooms_tasks(WORLD)
    goals, splits = defaultdict(set), defaultdict(set)
    for task in tasks:
        goals[task.start].add(task.goal)
        splits[task.start].add(task.split)
    assert len(tasks) == 48 and len(goals) == 12 and not set(goals) & set(CORNERS)
    assert all(g == set(CORNERS) for g in goals.values())  # a start never tells its goal
    assert all(len(s) == 1 for s in splits.values())  # a held-out start is held out with all its goals
    assert sorted(s for (s,) in splits.values()) == ["test"] * 3 + ["train"] * 9
    assert all(t.rooms == tasks[0].rooms for t in tasks)  # one map
    max_turns = RECIPE["env"]["max_turns"]
    assert max(len(shortest_path(t)) for t in tasks) <= max_turns
    assert all(random_walk_success(t, max_turns, episodes=2000) > 0 for t in tasks if t.split == "train")


def test_the_critic_context_names_the_goal_and_the_rooms_of_a_shortest_way():
    import doctest

    from lightning_agentrl.envs import rooms

    result = doctest.testmod(rooms, raise_on_error=False, verbose=False)
    assert (result.attempted, result.failed) == (1, 0)  # critic_text's example
    (task,) = [t for t in load_rooms_tasks(WORLD) if t.id == "maze_goals_gallery_to_attic"]
    assert RoomsEnv(task).critic_context == "the vault is attic; a shortest way from gallery: bakery, attic"
    (maze,) = [t for t in load_rooms_tasks(REPO / "tasks" / "rooms" / "maze.jsonl") if t.start == "nursery"]
    # the module docstring's example, and every world has one
    assert critic_text(maze) == "the vault is quarry; a shortest way from nursery: jetty, kitchen, orchard, pantry, quarry"
    for task in load_rooms_tasks(WORLD):
        room, way = task.start, critic_text(task).split(": ")[1].split(", ")
        for direction, expected in zip(shortest_path(task), way, strict=True):
            room = task.rooms[room][direction]
            assert room == expected
        assert room == task.goal


def test_nothing_the_policy_reads_names_the_goal():
    """Every task, walked by a shortest way and by seeded random answers (walls and errors too), to the
    goal or for 12 turns: no opening message and no observation holds the goal's name."""

    async def walk(task, actions):
        env = RoomsEnv(task)
        texts = [m["content"] for m in await env.reset()]
        for action in actions:
            result = await env.step(action)
            texts.append(result.observation)
            if result.done:
                return texts, result.reward
        return texts, 0.0

    rng, solved = random.Random(0), 0
    for task in load_rooms_tasks(WORLD):
        for actions in [shortest_path(task)] + [[rng.choice(["north", "south", "east", "west", "up"])
                                                 for _ in range(12)] for _ in range(5)]:
            texts, reward = asyncio.run(walk(task, actions))
            assert not any(task.goal in text for text in texts), (task.id, texts)
            solved += reward == 1.0
    assert solved >= 48  # every shortest way reached the goal, whose observation is "the vault."


def test_the_comparisons_run_every_arm_at_the_same_episodes_a_step():
    from lightning_agentrl.settings import load_settings

    for name in ("critic_level", "rooms_critic_level", "rooms_privileged"):
        spec = COMPARISONS[name]
        config = REPO / spec.get("config", f"configs/compare_{name}.yaml")  # copy-the-key's: compare_<name>.yaml
        assert config.read_text().startswith(f"# python benchmarks/compare.py {name}")
        assert "value/explained_variance" in spec["diagnostics"]
        budgets = set()
        for arm, overrides in spec["arms"].items():
            settings = load_settings(config, overrides)
            budgets.add(settings.rollout.group_size * settings.rollout.groups_per_step)
            assert settings.model.value_head == (settings.algorithm.advantage == "gae"), arm
        assert budgets == {32}, name
        assert all(a in spec["arms"] and b in spec["arms"] for a, b in spec["pairs"])
    long_turns = COMPARISONS["critic_level"]
    token = load_settings(REPO / "configs/compare_critic_level.yaml", long_turns["arms"]["gae token"])
    assert (token.algorithm.gamma, token.algorithm.gae_lambda, token.env.tasks.name) == (1.0, 1.0, "learn")
    makefile = (REPO / "Makefile").read_text().split("\nCOMPARISONS = ")[1].split("\n")[0]
    assert set(makefile.split()) == set(COMPARISONS)  # each has its `make compare-NAME`
    privileged = COMPARISONS["rooms_privileged"]
    assert load_settings(REPO / privileged["config"], privileged["arms"]["gae privileged"]).algorithm.privileged_critic
    assert load_settings(REPO / privileged["config"]).env.tasks.name == "maze_goals.jsonl"


GOALS = {"maze_goals_gallery_to_attic": "the vault is attic; a shortest way from gallery: bakery, attic",
         "maze_goals_gallery_to_quarry": "the vault is quarry; a shortest way from gallery: harbor, igloo, mill, library, "
                                         "pantry, quarry"}


@pytest.mark.parametrize("env_kind, contexts", [("RoomsEnv", GOALS), ("RoomsEnvNoCriticContext", dict.fromkeys(GOALS, ""))])
def test_the_privileged_critic_reads_the_hidden_goal_through_fit(tmp_path, env_kind, contexts):
    """Two tasks from one start with different goals: the policy's streams open identically, and the value
    head reads each episode's goal (its critic context) before the segment, as the module logs it; the
    comparison's control world tells the same critic nothing."""
    tasks = tmp_path / "goals.jsonl"
    chosen = [t for t in (json.loads(line) for line in WORLD.read_text().splitlines()) if t["id"] in GOALS]
    tasks.write_text("".join(json.dumps(t) + "\n" for t in chosen))
    settings = learn_settings(tmp_path, f"--env.kind=lightning_agentrl.envs.rooms:{env_kind}", f"--env.tasks={tasks}",
                              "--env.max_turns=3", "--model.value_head=true", "--algorithm.advantage=gae",
                              "--algorithm.privileged_critic=true", "--algorithm.value_coef=0.5",
                              "--trainer.grad_clip=1e9", "--trainer.lr=1e-2", "--trainer.max_steps=2")
    expected = ExpectedTurnValues()
    _, log = scripted_fit(settings, {"e0": ["north", "west"], "e1": ["east"]}, callbacks=[expected])
    from transformers import AutoTokenizer

    from lightning_agentrl.train import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings))
    assert {t.task_id: tokenizer.decode(t.critic_context_ids) for b in log.batches for t in b.trajectories} == contexts
    # the scripted walk (north, west: gallery -> attic) solves one task and not the other: the same opening
    assert {(t.task_id, t.reward) for b in log.batches for t in b.trajectories if t.episode_id.endswith("e0")} == {
        ("maze_goals_gallery_to_attic", 1.0), ("maze_goals_gallery_to_quarry", 0.0)}
    for step, want in zip(log.metrics, expected.expected, strict=True):
        assert step["value/mean"] == pytest.approx(want, abs=1e-4)
        assert step["time/critic_forward_s"] > 0
