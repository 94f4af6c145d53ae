"""The copy-the-key suite: a task the tiny CPU model can learn, that still needs tools and an observation.

Each task's workspace holds ``key.txt`` with a short secret and an empty ``answer.txt``. The
prompt is the same for every task: read key.txt, write its content to answer.txt, submit. The
hidden check passes only when answer.txt holds exactly the key. So a success needs three turns
(read_file -> write_file with the observed value -> submit) and the key is nowhere but in the
observation of the first turn: the policy cannot memorize it from the prompt, it must copy it
from a tool output (loss mask and multi-turn credit are exercised). A uniform guess succeeds with
probability ``1 / len(alphabet) ** key_length``.

The suite is written deterministically (same arguments -> same bytes) in the format of
``tasks/bugfix`` (see :mod:`lightning_agentrl.tasks`), with held-out tasks marked
``"split": "test"``::

    python -m lightning_agentrl.envs.learn_tasks tasks/learn
    python -m lightning_agentrl.tasks validate tasks/learn
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

KEY_FILE = "key.txt"
ANSWER_FILE = "answer.txt"
PROMPT = f"Read {KEY_FILE}, write its exact content to {ANSWER_FILE}, then submit."
HIDDEN_CHECK = "hidden_check/check_answer.py"
# The agent's tools never see this; it only needs the standard library.
_CHECK_TEMPLATE = """import sys
from pathlib import Path

answer = Path("{answer}").read_text(encoding="utf-8").strip() if Path("{answer}").exists() else ""
sys.exit(0 if answer == {key!r} else 1)
"""
_VISIBLE_CHECK = (
    "python -c \"import sys; sys.exit(0 if open('" + ANSWER_FILE + "').read().strip() else 1)\""
)


@dataclass(frozen=True)
class LearnSuiteSpec:
    """What the generator draws: ``key_length`` characters from ``alphabet``, per task.

    Keys are assigned round-robin over the alphabet's keys in a seeded order, so every key value
    appears in both splits about equally often (no split is easier by chance).
    """

    num_train: int = 40
    num_test: int = 20
    alphabet: str = "1234"
    key_length: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_train < 1 or self.num_test < 1:
            raise ValueError(f"num_train and num_test must be >= 1, got {self.num_train}, {self.num_test}")
        if self.key_length < 1:
            raise ValueError(f"key_length must be >= 1, got {self.key_length}")
        if len(set(self.alphabet)) != len(self.alphabet) or len(self.alphabet) < 2:
            raise ValueError(f"alphabet must have >= 2 distinct characters, got {self.alphabet!r}")
        if any(c.isspace() or c in "\"\\" for c in self.alphabet):
            raise ValueError("alphabet must not contain whitespace, quotes or backslashes (keys go into JSON)")

    @property
    def chance(self) -> float:
        """Success probability of a uniform guess."""
        return 1.0 / len(self.alphabet) ** self.key_length


def make_keys(spec: LearnSuiteSpec) -> list[str]:
    """``num_train + num_test`` keys, deterministic in ``spec``."""
    rng = random.Random(spec.seed)
    keys = []
    while len(keys) < spec.num_train + spec.num_test:
        block = ["".join(rng.choice(spec.alphabet) for _ in range(spec.key_length)) for _ in spec.alphabet]
        if spec.key_length == 1:  # one of each value per block: balanced splits
            block = list(spec.alphabet)
            rng.shuffle(block)
        keys.extend(block)
    return keys[: spec.num_train + spec.num_test]


def task_files(key: str) -> dict[str, dict[str, str]]:
    """The folder contents of one task: workspace, hidden and solution files."""
    return {
        "workspace": {KEY_FILE: key + "\n", ANSWER_FILE: ""},
        "hidden": {HIDDEN_CHECK: _CHECK_TEMPLATE.format(answer=ANSWER_FILE, key=key)},
        "solution": {ANSWER_FILE: key + "\n"},
    }


def write_suite(root: str | Path, spec: LearnSuiteSpec | None = None) -> list[str]:
    """(Re)write the suite under ``root``: one folder per task; returns the task ids in order."""
    spec = spec or LearnSuiteSpec()
    root = Path(root)
    if root.exists():
        shutil.rmtree(root)
    ids = []
    for index, key in enumerate(make_keys(spec)):
        split = "train" if index < spec.num_train else "test"
        task_id = f"{split}_{index:03d}"
        folder = root / task_id
        for part, files in task_files(key).items():
            for path, text in files.items():
                target = folder / part / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
        meta = {
            "id": task_id,
            "split": split,
            "prompt": PROMPT,
            "visible_test_command": _VISIBLE_CHECK,
            "hidden_test_command": f"python {HIDDEN_CHECK}",
            "scoring_timeout_s": 10,
        }
        (folder / "task.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        ids.append(task_id)
    (root / "README.md").write_text(_readme(spec), encoding="utf-8")
    return ids


def _readme(spec: LearnSuiteSpec) -> str:
    return (
        "# learn: copy the key (generated; do not edit by hand)\n\n"
        f"Written by `python -m lightning_agentrl.envs.learn_tasks {{this folder}}` with {spec}.\n"
        f"{spec.num_train} train and {spec.num_test} held-out (`\"split\": \"test\"`) tasks. The prompt is the\n"
        f"same for all: \"{PROMPT}\". `key.txt` holds {spec.key_length} character(s) from\n"
        f"`{spec.alphabet}`; a guess succeeds with probability {spec.chance:g}. Success needs read_file ->\n"
        "write_file with the observed key -> submit.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_agentrl.envs.learn_tasks", description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="suite folder to (re)write, e.g. tasks/learn")
    defaults = LearnSuiteSpec()
    parser.add_argument("--num-train", type=int, default=defaults.num_train)
    parser.add_argument("--num-test", type=int, default=defaults.num_test)
    parser.add_argument("--alphabet", default=defaults.alphabet)
    parser.add_argument("--key-length", type=int, default=defaults.key_length)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    spec = LearnSuiteSpec(args.num_train, args.num_test, args.alphabet, args.key_length, args.seed)
    ids = write_suite(args.root, spec)
    print(f"wrote {len(ids)} tasks to {args.root} (chance {spec.chance:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
