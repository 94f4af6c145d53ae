"""Every categorical and boolean training setting meets every other: ``fit`` through the real sandbox
service for 2 steps on a pairwise covering set of them, and every combination that cannot run is
refused by the settings validation with a message.

The covering set is built by a small greedy algorithm (seeded, so the table is the same on every
run; printed with ``-s``): while some pair of values is uncovered, draw random complete rows, keep
the one that covers most uncovered pairs. A row is valid when ``load_settings`` accepts it, so the
constraints are the validation's own; a pair no valid row can hold must be one of ``REFUSED``.

Each row runs in its own process (a timeout that escalates to SIGKILL) with tiny shapes and one
torch thread, two rows at a time; episode 0 of each group solves its task so groups have reward
variance. Each row asserts progress (2 steps), the token check (every action span checked),
finite losses and the metrics its path must log.

Not yet combined (the rollout service's partial-rollout deadlock with ``groups_per_step >= 2``):
rows with partial rollouts run one group per step, so they never meet ``mini_batches=2``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lightning_agentrl.settings import SettingsError, load_settings

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 150

FACTORS: dict[str, list] = {
    "algorithm.advantage": ["grpo", "rloo", "reinforce_decay", "gigpo", "gae"],
    "algorithm.aggregation": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
    "rollout.truncation": ["zero", "filter", "bootstrap"],
    "rollout.max_staleness": [0, 1, 2],
    "rollout.partial_rollout_s": [None, 0.0],
    "env.summarizer": ["none", "policy", "rule"],
    "model.value_head": [False, True],
    "algorithm.kl_coef": [0.0, 0.1],
    "algorithm.starpo_keep_fraction": [1.0, 0.5],
    "algorithm.staleness_weighting": ["none", "exp", "inverse"],
    "trainer.sync_weights_every": [1, 2],
    "trainer.ppo_epochs": [1, 2],
    "trainer.mini_batches": [1, 2],
    "algorithm.loss_mask": [True, False],
    "algorithm.grpo_std": ["population", "sample", "none"],
    "algorithm.kl_estimator": ["k1", "k3"],
    "engine.kind": ["torch"],  # vLLM: tests/test_fit.py (its start-up alone is most of this budget)
}

# (settings, the message naming the rule): combinations the validation must refuse
REFUSED = [
    ({"algorithm.advantage": "gae", "model.value_head": False}, "algorithm.advantage=gae needs model.value_head=true"),
    ({"rollout.truncation": "bootstrap", "algorithm.advantage": "grpo"},
     "rollout.truncation=bootstrap needs algorithm.advantage=gae"),
    ({"rollout.partial_rollout_s": 0.0, "rollout.max_staleness": 0},
     "rollout.partial_rollout_s needs rollout.max_staleness >= 1"),
    ({"trainer.sync_weights_every": 2, "rollout.max_staleness": 0},
     r"trainer.sync_weights_every \(2\) needs rollout.max_staleness >= 1"),
    ({"algorithm.staleness_weighting": "exp", "rollout.max_staleness": 0},
     "algorithm.staleness_weighting=exp needs rollout.max_staleness >= 1"),
    ({"trainer.mini_batches": 3, "rollout.groups_per_step": 2},
     r"trainer.mini_batches \(3\) must divide the groups each training process"),
    ({"trainer.mini_batches": 2, "rollout.groups_per_step": 2, "trainer.devices": 2},
     r"trainer.mini_batches \(2\) must divide .* \(1\)"),
    ({"algorithm.gigpo_similarity": 0.5, "algorithm.advantage": "grpo"},
     "algorithm.gigpo_similarity applies to algorithm.advantage=gigpo only"),
    ({"algorithm.gigpo_similarity": 1.0, "algorithm.advantage": "gigpo"}, "gigpo_similarity"),
]


def overrides(row: dict) -> list[str]:
    out = []
    for key, value in row.items():
        out.append(f"--{key}={'null' if value is None else str(value).lower() if isinstance(value, bool) else value}")
    # partial rollouts: one group per step until the rollout service's deadlock with several is fixed
    out.append(f"--rollout.groups_per_step={1 if row.get('rollout.partial_rollout_s') is not None else 2}")
    return out


def is_valid(row: dict) -> bool:
    if row["rollout.partial_rollout_s"] is not None and row["trainer.mini_batches"] > 1:
        return False  # one group per step (above): nothing to split
    try:
        load_settings(overrides=overrides(row))
    except SettingsError:
        return False
    return True


def covering_rows(seed: int = 0, candidates: int = 30) -> tuple[list[dict], set]:
    """Greedy pairwise cover of FACTORS by valid rows; also the pairs no valid row holds."""
    rng = random.Random(seed)
    names = list(FACTORS)
    uncovered = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
                 for va in FACTORS[a] for vb in FACTORS[b]}
    impossible: set = set()
    rows: list[dict] = []
    while uncovered - impossible:
        target = sorted(uncovered - impossible, key=repr)[0]
        best, best_gain = None, 0
        for _ in range(candidates):
            row = {name: rng.choice(values) for name, values in FACTORS.items()}
            (a, va), (b, vb) = target
            row[a], row[b] = va, vb
            if not is_valid(row):
                continue
            gain = sum(1 for pair in itertools.combinations(row.items(), 2) if pair in uncovered)
            if gain > best_gain:
                best, best_gain = row, gain
        if best is None:
            impossible.add(target)
            continue
        rows.append(best)
        uncovered -= set(itertools.combinations(best.items(), 2))
    return rows, impossible


ROWS, IMPOSSIBLE = covering_rows()


def test_print_the_covering_table():
    short = {name: name.split(".")[1][:12] for name in FACTORS}
    print("\n" + " | ".join(["#", *short.values()]))
    for index, row in enumerate(ROWS):
        print(" | ".join([str(index), *(str(row[name]) for name in FACTORS)]))
    print("pairs no valid row holds:", sorted(IMPOSSIBLE, key=repr))
    assert len(ROWS) <= 30


def test_every_pair_no_row_holds_is_a_refused_or_deferred_combination():
    for (a, va), (b, vb) in IMPOSSIBLE:
        pair = {a: va, b: vb}
        deferred = a == "rollout.partial_rollout_s" and b == "trainer.mini_batches"
        refused = any(all(pair.get(k, v) == v for k, v in rule.items()) and set(pair) <= set(rule)
                      for rule, _ in REFUSED)
        assert refused or deferred or _refused_on_its_own(pair), pair


def _refused_on_its_own(pair: dict) -> bool:
    """A pair whose every completion the validation refuses (e.g. gae without a value head)."""
    base = {name: values[0] for name, values in FACTORS.items()}
    for advantage, value_head, staleness in itertools.product(FACTORS["algorithm.advantage"], [False, True], [0, 1, 2]):
        row = {**base, "algorithm.advantage": advantage, "model.value_head": value_head,
               "rollout.max_staleness": staleness, **pair}
        if is_valid(row):
            return False
    return True


@pytest.mark.parametrize("rule,message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_combinations_that_cannot_run_are_refused_with_a_message(rule, message):
    args = [f"--{k}={'null' if v is None else v}" for k, v in rule.items()]
    with pytest.raises(SettingsError, match=message):
        load_settings(overrides=args)


def run_row(index: int, root: Path) -> tuple[dict | None, str, float]:
    """One row's ``fit`` in its own process: (its result, the tail of its output, seconds)."""
    out = root / f"row{index}.json"
    command = [sys.executable, "-m", "tests.fitting", str(out), str(root / f"row{index}"), *overrides(ROWS[index]),
               "--env.max_context_tokens=400", "--env.summary_max_tokens=32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # the run checkpoints and exits; past a grace, SIGKILL
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        return None, f"timed out after {RUN_TIMEOUT_S} s\n{output[-3000:]}", time.monotonic() - start
    result = json.loads(out.read_text()) if process.returncode == 0 and out.exists() else None
    return result, output[-3000:], time.monotonic() - start


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("combinations")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda i: run_row(i, root), range(len(ROWS))))
    print(f"\n{len(ROWS)} rows in {time.monotonic() - start:.0f} s:",
          ", ".join(f"{i}: {seconds:.0f} s" for i, (_, _, seconds) in enumerate(done)))
    return done


def expected_metrics(row: dict) -> set[str]:
    keys = {"loss/total", "loss/policy", "policy/grad_norm", "tokens/train", "train/optimizer_updates",
            "tokens/turns_checked", "reward/mean"}
    if row["model.value_head"]:
        keys |= {"loss/value", "value/clipfrac", "value/mean"}
    if row["algorithm.kl_coef"] > 0:
        keys.add("loss/kl")
    if row["algorithm.starpo_keep_fraction"] < 1:
        keys.add("filter/starpo_groups_dropped")
    if row["algorithm.advantage"] == "gigpo":
        keys.add("gigpo/num_anchor_groups")
    if row["rollout.max_staleness"] > 0:
        keys.add("staleness/max_lag")
    return keys


@pytest.mark.timeout(900)
@pytest.mark.parametrize("index", range(len(ROWS)))
def test_every_row_trains_two_steps(results, index):
    row = ROWS[index]
    result, output, _ = results[index]
    assert result is not None, f"row {index} {row} failed:\n{output}"
    assert result["global_step"] == 2
    steps = [m for m in result["metrics"] if "loss/total" in m]  # a step every episode was excluded from logs none
    assert steps, f"row {index}: no step trained"
    checked = result["metrics"][-1]["tokens/turns_checked"]
    assert checked == sum(result["turns"]) > 0  # every action span of every batch passed the token check
    for step in steps:
        assert expected_metrics(row) <= set(step), expected_metrics(row) - set(step)
        assert all(math.isfinite(step[key]) for key in step if key.startswith("loss/"))
        assert step["train/optimizer_updates"] >= 1
        assert step["train/optimizer_updates"] <= row["trainer.ppo_epochs"] * row["trainer.mini_batches"]
