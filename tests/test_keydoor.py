"""The key-and-door environment (``env.kind: keydoor``): its shipped maps, its states, and training
through ``fit`` with GiGPO merging the states that recur across different paths."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from lightning_agentrl.algorithms import advantages as adv
from lightning_agentrl.envs.keydoor import (
    DOOR_REWARD,
    KEY_REWARD,
    KeyDoorEnv,
    load_keydoor_tasks,
    parse_task,
    solve,
)
from lightning_agentrl.trajectory import TerminationReason
from tests.fitting import REPO, call, learn_settings, scripted_fit

pytestmark = pytest.mark.timeout(300)
MAP = ["#######",
       "#S..#G#",
       "#.#.A.#",
       "#a#.#.#",
       "#######"]


def moves(*directions: str) -> list[str]:
    return [call("move", direction=d) for d in directions]


def test_every_shipped_map_is_solvable_and_both_splits_exist():
    tasks = load_keydoor_tasks(REPO / "tasks" / "keydoor")
    assert {t.split for t in tasks} == {"train", "test"} and len(tasks) >= 10
    lengths = {t.id: len(solve(t) or []) for t in tasks}
    assert all(n > 0 for n in lengths.values()), lengths
    assert lengths["kd_000"] == 10
    # The shipped recipe gives every map enough turns to reach its goal.
    import yaml

    recipe = yaml.safe_load((REPO / "configs" / "keydoor.yaml").read_text())
    assert recipe["env"]["max_turns"] >= max(lengths.values()), lengths


def test_equal_states_reached_by_different_paths_have_equal_text():
    async def walk(directions):
        env = KeyDoorEnv(parse_task({"id": "t", "map": MAP}, "test"))
        await env.reset()
        results = [await env.step(action) for action in moves(*directions)]
        return env, results

    around, rewards = asyncio.run(walk(["south", "south", "north", "east", "west", "north"]))
    direct, _ = asyncio.run(walk(["south", "south", "north", "north"]))
    assert around.state_text == direct.state_text == "at 1,1 keys: a open: none"
    assert around.state_key == direct.state_key
    assert [r.reward for r in rewards] == [0.0, KEY_REWARD, 0.0, 0.0, 0.0, 0.0]
    assert rewards[3].observation.startswith("A wall blocks the way.")  # a bump keeps the state
    # the agent sees the map (its square, the keys still lying, the doors still closed) in each observation
    assert rewards[-1].observation == "You moved.\n#######\n#@..#G#\n#.#.A.#\n#.#.#.#\n#######\nkeys: a"


def _reachable_state_texts(task) -> list[str]:
    """The state text of every (square, keys, doors) state reachable on ``task``'s map."""
    from collections import deque

    from lightning_agentrl.envs.keydoor import MOVES

    env, texts = KeyDoorEnv(task), {}
    queue = deque([(env.position, frozenset(), frozenset())])
    while queue:
        state = queue.popleft()
        if state in texts:
            continue
        env.load_state_dict({"position": state[0], "keys": state[1], "opened": state[2]})
        texts[state] = env.state_text
        for delta in MOVES.values():
            env.load_state_dict({"position": state[0], "keys": state[1], "opened": state[2]})
            if not env._move(delta)[2]:
                queue.append((env.position, frozenset(env.keys), frozenset(env.opened)))
    return list(texts.values())


def test_different_states_never_merge_in_similarity_mode_on_any_map():
    """At the shipped recipe's gigpo_similarity (0.99), every reachable state of every shipped map, and of a
    12x12 room, is its own anchor group. Before, the state text was the whole map: two squares differed by
    one character in hundreds, and a 12x12 room's states fell into a few groups."""
    import yaml

    threshold = yaml.safe_load((REPO / "configs" / "keydoor.yaml").read_text())["algorithm"]["gigpo_similarity"]
    rows = [list("#" + "." * 10 + "#") for _ in range(10)]
    rows[0][1], rows[9][10] = "SG"
    room = ["#" * 12, *("".join(row) for row in rows), "#" * 12]
    for task in [*load_keydoor_tasks(REPO / "tasks" / "keydoor"), parse_task({"id": "room", "map": room}, "x")]:
        texts = _reachable_state_texts(task)
        ids = adv.anchor_group_ids(texts, torch.zeros(len(texts), dtype=torch.long), threshold)
        assert len(set(texts)) == len(texts) > 10 and int(ids.max()) + 1 == len(texts), task.id


@pytest.mark.parametrize(("line", "problem"), [
    ({"id": "x", "map": ["###", "#S#", "###"]}, "exactly one S (start) and one G"),
    ({"id": "x", "map": ["####", "#SG.", "####"]}, "border must be walls"),
    ({"id": "x", "map": ["#####", "#S?G#", "#####"]}, "unknown map glyphs ['?']"),
    ({"id": "x", "maze": []}, "keys id, map and optionally split"),
    ({"id": None, "map": MAP}, "id must be a non-empty string, got None"),  # was the task id "None"
])
def test_a_malformed_task_line_is_refused_naming_the_line(line, problem):
    with pytest.raises(ValueError, match="tasks.jsonl:3") as err:
        parse_task(line, "tasks.jsonl:3")
    assert problem in str(err.value)


def test_keydoor_trains_through_fit_and_gigpo_merges_recurring_states(tmp_path):
    """Per group, episode 0 solves the map (10 moves: key, door, goal); episode 1 walks east and
    west for 10 turns. Episode 1's states recur within it and its start state is episode 0's: per
    group 11 anchor states for 20 turns, the start state shared by 6 turns, in similarity mode as with
    exact keys (the state texts, square, keys and doors, differ by more than 1% between any two states;
    the counts are what they were when the state text was the whole map, since equal states still
    have equal texts and different states different ones)."""
    tasks = tmp_path / "maze.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"m{i}", "map": MAP}) + "\n" for i in range(2)))
    settings = learn_settings(tmp_path, "--env.kind=keydoor", f"--env.tasks={tasks}", "--env.max_turns=10",
                              "--algorithm.advantage=gigpo", "--algorithm.gigpo_similarity=0.99",
                              "--trainer.max_steps=1")
    solution = solve(parse_task({"id": "m", "map": MAP}, "test"))
    _, log = scripted_fit(settings, {"e0": moves(*solution), "e1": moves(*["east", "west"] * 5)})
    (batch,), (step,) = log.batches, log.metrics
    assert step["gigpo/num_anchor_groups"] == 22.0
    assert step["gigpo/max_anchor_group_size"] == 6.0
    assert step["gigpo/anchor_hit_rate"] == pytest.approx(11 / 20)
    exact = adv.anchor_group_ids(batch.turn_state_keys, batch.group_ids[batch.turn_episode])
    assert int(exact.max()) + 1 == 22  # the hashes of equal texts group the same turns
    solved = [t for t in batch.trajectories if t.episode_id.endswith("e0")]
    assert [t.termination for t in solved] == [TerminationReason.SUBMITTED] * 2
    rewards = [turn.reward for turn in solved[0].turns]
    assert rewards == [0.0, KEY_REWARD, 0.0, 0.0, 0.0, 0.0, 0.0, DOOR_REWARD, 0.0, 1.0]
    assert step["reward/mean"] == pytest.approx(0.5)



def test_preflight_reads_keydoor_tasks_through_the_environment(tmp_path):
    from lightning_agentrl.preflight import PreflightError, check_tasks
    from lightning_agentrl.settings import load_settings

    shipped = ["--env.kind=keydoor", f"--env.tasks={REPO / 'tasks' / 'keydoor'}", "--eval.every_n_steps=1"]
    check_tasks(load_settings(None, shipped))  # train and test splits in the shipped JSONL
    only_train = tmp_path / "train.jsonl"
    only_train.write_text(json.dumps({"id": "m", "map": MAP}) + "\n")
    with pytest.raises(PreflightError, match=f"eval.split: no test tasks in {only_train}"):
        check_tasks(load_settings(None, [*shipped[:1], f"--env.tasks={only_train}", *shipped[2:]]))
    only_train.write_text('{"id": "m"}\n')
    with pytest.raises(PreflightError, match=r"env.tasks: .*train.jsonl:1: a task is an object"):
        check_tasks(load_settings(None, [*shipped[:1], f"--env.tasks={only_train}"]))


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("url", ["closed", None])
def test_keydoor_trains_and_evaluates_without_the_sandbox_service(tmp_path, url, capsys):
    """``keydoor`` does not use the sandbox service (``uses_sandbox`` False): with ``sandbox.url`` at a closed
    port, neither ``fit`` nor ``evaluate`` checks it (the service check itself fails on it); unset, neither
    starts a local server (it would write ``sandbox_server.log`` into the output folder)."""
    from lightning_agentrl.__main__ import main
    from lightning_agentrl.preflight import PreflightError, check_sandbox

    tasks = tmp_path / "maze.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"m{i}", "map": MAP}) + "\n" for i in range(2)))
    secret = "tok-s3cret-9f2"
    sandbox = [] if url is None else [f"--sandbox.url=http://127.0.0.1:{_closed_port()}", f"--sandbox.token={secret}",
                                      "--tracking.enabled=true"]
    settings = learn_settings(tmp_path, "--env.kind=keydoor", f"--env.tasks={tasks}", "--env.max_turns=2",
                              "--trainer.max_steps=1", *sandbox)
    if url is not None:
        with pytest.raises(PreflightError, match="sandbox.url"):
            check_sandbox(settings.sandbox, None)
    result, log = scripted_fit(settings, {"*": moves("east", "south")})
    assert result.global_step == 1
    (batch,) = log.batches
    assert len(batch.trajectories) == 4 and all(t.info.get("sandbox_error") is None for t in batch.trajectories)
    assert not list(result.run_dir.glob("sandbox_server*.log"))
    if url is not None:  # the token is a secret: in no file of the run folder (settings, MLflow store), masked in MLflow
        from mlflow import MlflowClient

        assert not [p for p in result.run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
        params = MlflowClient(result.tracking_uri).get_run(result.mlflow_run_id).data.params
        assert params["sandbox.token"] == "**********"
    # `evaluate` on the saved run: the same settings, no service started or checked either
    out = tmp_path / "evaluation"
    code = main(["evaluate", str(result.run_dir), "--split", "all", "--samples", "1", "--out", str(out), "--json"])
    assert code == 0, capsys.readouterr().err
    assert json.loads((out / "evaluation.json").read_text())["episodes"] == 2
    assert not list(out.glob("sandbox_server*.log"))


def test_waiting_for_the_sandbox_service_is_refused_for_an_environment_without_one(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "lightning_agentrl", "fit", "--config", "configs/keydoor.yaml",
         f"--run.dir={tmp_path / 'run'}", "--rollout.on_infra_failure=wait"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "rollout.on_infra_failure: 'wait' polls the sandbox service's health" in done.stderr
    assert "'keydoor' uses no sandbox service" in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any work
