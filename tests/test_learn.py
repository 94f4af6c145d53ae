"""The copy-the-key suite, the format-only warm start and the held-out evaluation (fast checks only)."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch

from benchmarks.warm_start import (
    demonstration_turns,
    make_demonstrations,
    masked_nll,
    opening_messages,
    render_demonstration,
)
from lightning_agentrl.envs.learn_tasks import (
    ANSWER_FILE,
    KEY_FILE,
    PROMPT,
    LearnSuiteSpec,
    make_keys,
    task_files,
    write_suite,
)
from lightning_agentrl.envs.tools import parse_tool_call
from lightning_agentrl.tasks import load_tasks, validate_task

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "tasks" / "learn"


def _same_tree(a: Path, b: Path) -> bool:
    comparison = filecmp.dircmp(a, b)
    if comparison.left_only or comparison.right_only or comparison.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, comparison.common_files, shallow=False)
    return not mismatch and not errors and all(_same_tree(a / d, b / d) for d in comparison.common_dirs)


def test_generator_is_deterministic_and_matches_the_committed_suite(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    ids = write_suite(first)
    assert write_suite(second) == ids
    assert _same_tree(first, second)
    # the committed data is exactly what the generator writes with its defaults
    assert _same_tree(first, SUITE)


def test_splits_are_balanced_and_keys_come_from_the_alphabet():
    spec = LearnSuiteSpec()
    keys = make_keys(spec)
    assert len(keys) == spec.num_train + spec.num_test
    train, test = keys[: spec.num_train], keys[spec.num_train :]
    for split in (train, test):  # every key value equally often in each split
        assert sorted(set(split)) == sorted(spec.alphabet)
        assert max(split.count(k) for k in set(split)) == min(split.count(k) for k in set(split))
    assert make_keys(LearnSuiteSpec(seed=1)) != keys
    assert spec.chance == pytest.approx(1 / len(spec.alphabet))
    long_keys = make_keys(LearnSuiteSpec(alphabet="abc", key_length=3, num_train=5, num_test=2))
    assert all(len(k) == 3 and set(k) <= set("abc") for k in long_keys)


def test_loaded_suite_has_the_same_prompt_everywhere_and_the_key_only_in_key_txt():
    tasks = load_tasks(SUITE)
    assert len(load_tasks(SUITE, split="train")) == 40 and len(load_tasks(SUITE, split="test")) == 20
    for task in tasks:
        assert task.prompt == PROMPT  # nothing task-specific to memorize: the key must be read
        key = task.files[KEY_FILE].strip()
        assert task.files[ANSWER_FILE] == ""
        assert task.solution_files == {ANSWER_FILE: key + "\n"}


@pytest.mark.parametrize("index", [0, 45])
def test_learn_tasks_validate(index, tmp_path):
    task = load_tasks(SUITE)[index]
    assert validate_task(task) == []


def test_hidden_check_rejects_a_wrong_answer(tmp_path):
    files = task_files("7")
    task_dir = tmp_path / "t"
    for part, contents in files.items():
        for path, text in contents.items():
            (task_dir / part / path).parent.mkdir(parents=True, exist_ok=True)
            (task_dir / part / path).write_text(text)
    (task_dir / "solution" / ANSWER_FILE).write_text("3\n")  # a wrong "fix": the hidden check must fail it
    (task_dir / "task.json").write_text(
        json.dumps(
            {"id": "t", "prompt": PROMPT, "visible_test_command": "python -c pass",
             "hidden_test_command": "python hidden_check/check_answer.py"}
        )
    )
    (task,) = load_tasks(task_dir)
    assert any("hidden tests fail with the reference solution" in p for p in validate_task(task))


def test_demonstration_masks_cover_exactly_the_actions(tiny_tokenizer):
    from lightning_agentrl.rollout.chat import ChatCodec

    codec = ChatCodec(tiny_tokenizer)
    turns = demonstration_turns("7", "3", detour=True)
    ids, mask = render_demonstration(codec, turns)
    assert len(ids) == len(mask)
    prompt = codec.prompt_ids(opening_messages())
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    # the mask-1 spans, in order, are exactly each action's encoding plus eos
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(ids[start:i])
            start = None
    assert spans == [codec.encode(action) + [codec.eos_token_id] for action, _ in turns]
    assert [parse_tool_call(action).name for action, _ in turns] == ["read_file", "run", "write_file", "submit"]
    # observations (the key among them) are never trained on
    key_observation = codec.observation_ids("7\n").all
    at = len(prompt) + len(spans[0])
    assert ids[at : at + len(key_observation)] == key_observation and not any(mask[at : at + len(key_observation)])
    assert sum(mask) == sum(len(s) for s in spans)


def test_demonstrations_write_a_random_value_not_the_key(tiny_tokenizer):
    from lightning_agentrl.rollout.chat import ChatCodec

    codec = ChatCodec(tiny_tokenizer)
    spec = LearnSuiteSpec()
    key = spec.alphabet[0]
    demos = make_demonstrations(codec, [key], spec, num=200, seed=0)
    written = []
    for ids, _ in demos:
        text = codec.decode(ids)
        written.append(json.loads(text.rsplit('"content": ', 1)[1].split("}", 1)[0]))
    # independent of the key: about chance agreement, and every value of the alphabet appears
    assert set(written) == set(spec.alphabet)
    assert abs(written.count(key) / len(written) - spec.chance) < 0.1
    assert make_demonstrations(codec, [key], spec, num=5, seed=0) == demos[:5]


def test_echo_demonstrations_copy_from_the_user_message_only(tiny_tokenizer):
    from benchmarks.warm_start import ECHO_PROMPTS, NOTE_FILE, echo_prompt
    from lightning_agentrl.rollout.chat import ChatCodec

    codec = ChatCodec(tiny_tokenizer)
    spec = LearnSuiteSpec()
    demos = make_demonstrations(codec, ["7"], spec, num=100, seed=0, echo_prob=0.5)
    echo = [codec.decode(ids) for ids, _ in demos if NOTE_FILE in codec.decode(ids)]
    assert 30 < len(echo) < 70
    for text in echo:
        value = text.rsplit('"content": "', 1)[1][0]
        assert any(echo_prompt(value, v) in text for v in range(len(ECHO_PROMPTS)))
        assert PROMPT not in text and KEY_FILE not in text  # never in the copy-the-key task's context
    with pytest.raises(ValueError, match="echo_prob"):
        make_demonstrations(codec, ["7"], spec, num=1, echo_prob=1.5)


def test_masked_nll_ignores_masked_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 1, 0]])
    lp = torch.log_softmax(logits, -1)
    expected = -(lp[0, 0, ids[0, 1]] + lp[0, 1, ids[0, 2]] + lp[1, 2, ids[1, 3]]) / 3
    assert masked_nll(logits, ids, mask).item() == pytest.approx(expected.item(), abs=1e-6)
    changed = logits.clone()
    changed[0, 3:] += 100.0  # predictions of masked targets do not matter
    assert masked_nll(changed, ids, mask).item() == pytest.approx(expected.item(), abs=1e-6)


def test_value_can_be_left_out_of_the_warm_start_loss(tiny_tokenizer):
    from lightning_agentrl.rollout.chat import ChatCodec

    codec = ChatCodec(tiny_tokenizer)
    turns = demonstration_turns("3", "2")
    ids, with_value = render_demonstration(codec, turns)
    same_ids, without_value = render_demonstration(codec, turns, value_in_loss=False)
    assert same_ids == ids
    differ = [i for i, (a, b) in enumerate(zip(with_value, without_value, strict=True)) if a != b]
    assert [tiny_tokenizer.decode([ids[i]]) for i in differ] == ["2"]  # only the written value


def test_held_out_evaluation_checks_its_arguments_and_resumes():
    from lightning_agentrl.callbacks.evaluation import HeldOutEvaluation

    tasks = load_tasks(SUITE, split="test")
    with pytest.raises(ValueError, match="at least one task"):
        HeldOutEvaluation([])
    with pytest.raises(ValueError, match="every_n_steps"):
        HeldOutEvaluation(tasks, every_n_steps=0)
    with pytest.raises(ValueError, match="temperature"):
        HeldOutEvaluation(tasks, temperature=-1.0)
    first = HeldOutEvaluation(tasks)
    first.history = [{"step": 0, "success": 0.25, "submitted_frac": 1.0, "episodes": 80}]
    second = HeldOutEvaluation(tasks)
    second.load_state_dict(first.state_dict())
    assert second.history == first.history and second._evaluated(0) and not second._evaluated(10)
