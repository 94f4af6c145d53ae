"""``python -m lightning_agentrl sft``: demonstrations from the environments' own solvers, trained on their action
tokens only, in a run folder like ``fit``'s whose ``policy/`` starts ``fit``.

What would fail if the wiring broke: the demonstrations' text against the chat template's own rendering of the
same conversation (prompt, tools text, observations in the tool role), their mask-1 tokens against the actions
exactly, the demonstrations' rewards (played through the real environment, the sandbox service for a coding
task), the loss in MLflow going down, the policy's weights moving, and ``fit`` starting from that policy.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from lightning_agentrl.__main__ import main
from lightning_agentrl.envs.keydoor import KeyDoorEnv, load_keydoor_tasks, solve
from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.sft import play_demonstration
from tests.fitting import REPO, TINY
from tests.test_smollm2 import smol_file  # noqa: F401 - the named model, installed once (a fixture)

KEYDOOR = REPO / "configs" / "keydoor.yaml"
CACHE = f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}"


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of 1 in ``mask``."""
    runs, start = [], None
    for i, value in enumerate([*mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_keydoor_demonstration_is_the_rollout_conversation_with_only_actions_in_the_loss(tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    task = next(t for t in load_keydoor_tasks(REPO / "tasks" / "keydoor", split="train") if len(solve(t)) > 4)
    env = KeyDoorEnv(task)
    demo = asyncio.run(play_demonstration(env, codec, random.Random(0), max_observation_chars=2000))
    assert demo.reward == 1.0 and demo.num_turns == len(solve(task))  # a shortest walk that reaches the goal
    # replay the same actions to get the conversation, and render it with the chat template itself
    replay = KeyDoorEnv(task)
    messages = asyncio.run(replay.reset())
    actions = replay.demonstration(random.Random(0))
    for action in actions:
        messages.append({"role": "assistant", "content": action})
        result = asyncio.run(replay.step(action))
        if not result.done:
            messages.append({"role": "tool", "content": result.observation})
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert tiny_tokenizer.decode(demo.token_ids) == rendered.removesuffix("\n")  # ChatML ends a turn with a newline
    trained = [tiny_tokenizer.decode(demo.token_ids[a:b]) for a, b in spans(demo.loss_mask)]
    assert trained == [action + "<|im_end|>" for action in actions]  # every action and its end of turn, nothing else


def run_sft(root: Path, *overrides: str) -> Path:
    run_dir = root / "sft"
    code = main(["sft", "--config", str(KEYDOOR), f"--run.dir={run_dir}", CACHE, "--trainer.threads=1", *TINY,
                 "--sft.steps=6", "--sft.batch_size=2", "--sft.lr=3e-3", "--trainer.checkpoint_every=3", *overrides])
    assert code == 0
    return run_dir


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    return run_sft(tmp_path_factory.mktemp("sft"))


def test_sft_loss_goes_down_and_its_policy_moved_from_the_base(sft_run):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    run_id = (sft_run / "mlflow_run_id.txt").read_text().strip()
    history = MlflowClient(f"sqlite:///{sft_run / 'mlflow.db'}").get_metric_history(run_id, "sft/loss")
    losses = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert len(losses) == 6 and all(b < a for a, b in zip(losses, losses[1:], strict=False)) and losses[-1] < 0.85 * losses[0]
    demos = [json.loads(line) for line in (sft_run / "demonstrations.jsonl").read_text().splitlines()]
    train_ids = {t.id for t in load_keydoor_tasks(REPO / "tasks" / "keydoor", split="train")}
    assert sorted(d["task_id"] for d in demos) == sorted(train_ids)  # every training task, no held-out one
    assert all(d["reward"] == 1.0 for d in demos)
    assert (sft_run / "checkpoints" / "last.ckpt").exists() and (sft_run / "settings.yaml").exists()
    policy = AutoModelForCausalLM.from_pretrained(sft_run / "policy")
    settings = json.loads((sft_run / "policy" / "config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(REPO / ".cache" / "lightning_agentrl" / _tiny_folder(settings))
    moved = [name for name, p in policy.named_parameters() if not torch.equal(p, base.get_parameter(name))]
    assert moved  # the policy folder holds the trained weights, not the base


def _tiny_folder(config: dict) -> str:
    from lightning_agentrl.models.tiny import TinyModelConfig, build_tiny_model

    path = build_tiny_model(REPO / ".cache" / "lightning_agentrl",
                            TinyModelConfig(hidden_size=config["hidden_size"], num_hidden_layers=config["num_hidden_layers"]))
    return path.name


def test_fit_starts_from_the_sft_policy(sft_run, tmp_path):
    from lightning_agentrl.export import load_checkpoint

    code = main(["fit", "--config", str(KEYDOOR), f"--run.dir={tmp_path / 'rl'}", f"--model.path={sft_run / 'policy'}",
                 "--trainer.threads=1", "--trainer.max_steps=1", "--env.max_turns=4", "--engine.max_new_tokens=24",
                 "--rollout.groups_per_step=1", "--rollout.max_in_flight=4", "--tracking.enabled=false"])
    assert code == 0
    checkpoint = load_checkpoint(tmp_path / "rl" / "checkpoints" / "last.ckpt")
    assert checkpoint["hyper_parameters"]["model_path"] == str((sft_run / "policy").resolve())


def test_coding_demonstrations_are_played_in_the_sandbox_and_solve_their_tasks(tmp_path):
    run_dir, tasks = tmp_path / "sft", tmp_path / "tasks"
    for name in ("train_000", "train_001", "test_040"):
        shutil.copytree(REPO / "tasks" / "learn" / name, tasks / name)
    code = main(["sft", "--config", str(REPO / "configs" / "smoke.yaml"), f"--run.dir={run_dir}", CACHE, *TINY,
                 f"--env.tasks={tasks}", "--trainer.threads=1", "--sft.steps=1", "--sft.batch_size=2",
                 "--tracking.enabled=false"])
    assert code == 0
    demos = [json.loads(line) for line in (run_dir / "demonstrations.jsonl").read_text().splitlines()]
    assert [d["task_id"] for d in demos] == ["train_000", "train_001"]  # never the held-out task
    assert all(d["reward"] == 1.0 for d in demos)  # the hidden check passed: a real copy
    first = demos[0]["text"]
    key = (tasks / "train_000" / "workspace" / "key.txt").read_text()
    assert f'"content": {json.dumps(key)}' in first and "<|im_start|>tool\n" + key in first  # read, then copied


def learn_suite(root: Path, *, wrong: tuple[str, ...]) -> Path:
    """Two training tasks and a held-out one of tasks/learn; the tasks in ``wrong`` get a solution that writes a
    wrong key (the hidden check fails: reward 0)."""
    for name in ("train_000", "train_001", "test_040"):
        shutil.copytree(REPO / "tasks" / "learn" / name, root / name)
    for name in wrong:
        key = (root / name / "workspace" / "key.txt").read_text()
        (root / name / "solution" / "answer.txt").write_text("9" if key.strip() != "9" else "8")
    return root


def test_failed_demonstrations_are_left_out_and_none_succeeding_stops_sft_before_training(tmp_path, capsys):
    args = ["sft", "--config", str(REPO / "configs" / "smoke.yaml"), CACHE, *TINY, "--trainer.threads=1",
            "--sft.steps=1", "--sft.batch_size=1", "--tracking.enabled=false"]
    one_wrong = learn_suite(tmp_path / "one_wrong", wrong=("train_000",))
    with pytest.warns(Warning, match=r"sft: left out 1 where the solver failed \(reward below 1\)"):
        assert main([*args, f"--run.dir={tmp_path / 'kept'}", f"--env.tasks={one_wrong}"]) == 0
    demos = [json.loads(line) for line in (tmp_path / "kept" / "demonstrations.jsonl").read_text().splitlines()]
    assert [(d["task_id"], d["reward"]) for d in demos] == [("train_001", 1.0)]  # the failed one is not trained on
    all_wrong = learn_suite(tmp_path / "all_wrong", wrong=("train_000", "train_001"))
    assert main([*args, f"--run.dir={tmp_path / 'none'}", f"--env.tasks={all_wrong}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: env.tasks: no demonstration of the 2 training tasks in {all_wrong} can be trained on (2 where the "
        "solver failed (reward below 1))")
    assert not (tmp_path / "none" / "checkpoints").exists() and not (tmp_path / "none" / "policy").exists()


@pytest.mark.parametrize(("override", "message"), [
    ("--env.split=test", "error: env.split: sft learns from the training split only"),
    ("--run.resume=last", "error: run.resume: sft does not resume"),
    ("--sft.steps=0", "sft.steps: Input should be greater than or equal to 1"),
    ("--env.max_turns=2", "error: env.tasks: no demonstration of the 7 training tasks in tasks/keydoor can be trained "
                          "on (7 longer than env.max_turns=2 turns)"),
])
def test_sft_refuses_what_it_cannot_train_before_training(tmp_path, capsys, override, message):
    code = main(["sft", "--config", str(KEYDOOR), f"--run.dir={tmp_path / 'sft'}", CACHE, *TINY, override])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "sft" / "checkpoints").exists()


@pytest.mark.slow
def test_named_model_warm_starts_on_its_own_chat_template(tmp_path, smol_file):  # noqa: F811 - the fixture
    """SmolLM2-135M-Instruct (ChatML): two steps on the same two rooms demonstrations lower their loss."""
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "sft"
    code = main(["sft", "--config", str(REPO / "configs" / "credit_gigpo.yaml"), f"--run.dir={run_dir}", CACHE,
                 "--model.path=smollm2-135m-instruct", f"--env.tasks={REPO / 'tasks' / 'rooms' / 'shortcut.jsonl'}",
                 "--trainer.threads=1", "--sft.steps=2", "--sft.batch_size=2", "--sft.lr=1e-4"])
    assert code == 0
    demos = [json.loads(line) for line in (run_dir / "demonstrations.jsonl").read_text().splitlines()]
    assert len(demos) == 2 and all(d["reward"] == 1.0 and "<|im_start|>assistant\n" in d["text"] for d in demos)
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    history = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}").get_metric_history(run_id, "sft/loss")
    first, second = (m.value for m in sorted(history, key=lambda m: m.step))
    assert second < first
    assert AutoModelForCausalLM.from_pretrained(run_dir / "policy").num_parameters() > 100_000_000
