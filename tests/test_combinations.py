"""Every categorical and boolean training setting meets every other: ``fit`` through the real sandbox
service for 2 steps on a pairwise covering set of them, and every combination that cannot run is
refused by the settings validation with a message.

The covering set ``ROWS`` was built by :func:`covering_rows`, a small greedy algorithm (seeded;
``python -m tests.test_combinations`` prints it again): while some pair of values is uncovered,
draw random complete rows (``algorithm.grpo_std``, a field of ``grpo`` only, at its default in the rows of
other estimators), keep the one that covers most uncovered pairs. A row is valid when
``load_settings`` accepts it, so the constraints are the validation's own. The tests check that
the fixed table still covers every pair that some valid row can hold, and that each pair it leaves
out is refused by the validation. The table is printed with ``-s``.

Each row runs in its own process, forked from a server that imported torch, Lightning and
transformers once (a timeout that escalates from SIGTERM to SIGKILL), with tiny shapes and one
torch thread, two rows at a time; episode 0 of each group solves its task so groups have reward
variance. Each row asserts progress (2 steps), the token check (every action span checked),
finite losses and the metrics its path must log.

Every row runs two groups per step. The last row was added by hand after the greedy table: it
joins partial rollouts with ``mini_batches=2`` and ``sync_weights_every=2``, pairs the table once
left out while partial rollouts deadlocked with several groups per step (fixed in the rollout
service). Not factors yet: ``rollout.dynamic_sampling``, ``algorithm.gigpo_similarity`` and
``engine.top_p < 1`` (each has its own fit-level test).
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import random
import signal
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
    ({"algorithm.grpo_std": "sample", "algorithm.advantage": "rloo"},
     "algorithm.grpo_std applies to algorithm.advantage=grpo only"),
    ({"algorithm.gigpo_similarity": 0.5, "algorithm.advantage": "grpo"},
     "algorithm.gigpo_similarity applies to algorithm.advantage=gigpo only"),
    ({"algorithm.gigpo_similarity": 1.0, "algorithm.advantage": "gigpo"}, "gigpo_similarity"),
    ({"rollout.max_sampling_rounds": 2}, "rollout.max_sampling_rounds applies to rollout.dynamic_sampling=true"),
    ({"trainer.mini_batches": 2, "trainer.devices": "auto"}, "trainer.mini_batches > 1 needs trainer.devices as a number"),
]


def overrides(row: dict) -> list[str]:
    out = []
    for key, value in row.items():
        out.append(f"--{key}={'null' if value is None else str(value).lower() if isinstance(value, bool) else value}")
    out.append("--rollout.groups_per_step=2")
    return out


# the settings the cross-field rules read: validity is decided (and cached) on these alone
CONSTRAINED = ("algorithm.advantage", "algorithm.grpo_std", "model.value_head", "rollout.truncation", "rollout.max_staleness",
               "rollout.partial_rollout_s", "algorithm.staleness_weighting", "trainer.sync_weights_every",
               "trainer.mini_batches")
_VALID: dict[tuple, bool] = {}


def is_valid(row: dict) -> bool:
    key = tuple(row[name] for name in CONSTRAINED)
    if key not in _VALID:
        _VALID[key] = _validates(row)
    return _VALID[key]


def _validates(row: dict) -> bool:
    try:
        load_settings(overrides=overrides(row))
    except SettingsError:
        return False
    return True


def covering_rows(seed: int = 0, candidates: int = 300) -> tuple[list[dict], set]:
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
            if row["algorithm.advantage"] != "grpo":  # a grpo field: the others take it at its default only
                row["algorithm.grpo_std"] = FACTORS["algorithm.grpo_std"][0]
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


ROWS = [dict(zip(FACTORS, row, strict=True)) for row in [
    ('gae', 'seq-mean-token-mean', 'zero', 1, 0.0, 'policy', True, 0.1, 0.5, 'inverse', 1, 1, 2, True, 'population', 'k3', 'torch'),
    ('gae', 'seq-mean-token-sum', 'zero', 2, None, 'rule', True, 0.0, 1.0, 'exp', 1, 2, 1, False, 'population', 'k1', 'torch'),
    ('gae', 'token-mean', 'bootstrap', 2, None, 'none', True, 0.1, 1.0, 'none', 2, 1, 1, True, 'population', 'k3', 'torch'),
    ('gae', 'seq-mean-token-mean', 'filter', 0, None, 'policy', True, 0.1, 0.5, 'none', 1, 2, 1, False, 'population', 'k1', 'torch'),
    ('gigpo', 'seq-mean-token-mean', 'filter', 1, None, 'rule', False, 0.0, 1.0, 'inverse', 2, 2, 2, False, 'population', 'k3', 'torch'),
    ('gigpo', 'seq-mean-token-sum', 'filter', 2, 0.0, 'none', False, 0.1, 0.5, 'inverse', 2, 1, 2, False, 'population', 'k1', 'torch'),
    ('gigpo', 'token-mean', 'zero', 1, 0.0, 'none', False, 0.0, 0.5, 'exp', 1, 1, 1, True, 'population', 'k3', 'torch'),
    ('gigpo', 'seq-mean-token-sum', 'zero', 1, 0.0, 'policy', False, 0.0, 1.0, 'none', 2, 2, 2, True, 'population', 'k3', 'torch'),
    ('gigpo', 'token-mean', 'filter', 1, 0.0, 'rule', True, 0.1, 1.0, 'exp', 2, 2, 2, True, 'population', 'k1', 'torch'),
    ('gigpo', 'token-mean', 'filter', 0, None, 'rule', True, 0.1, 1.0, 'none', 1, 1, 2, True, 'population', 'k3', 'torch'),
    ('grpo', 'seq-mean-token-mean', 'zero', 2, 0.0, 'none', True, 0.0, 0.5, 'exp', 2, 2, 2, False, 'sample', 'k1', 'torch'),
    ('grpo', 'seq-mean-token-sum', 'filter', 1, None, 'none', False, 0.1, 1.0, 'exp', 1, 1, 1, True, 'none', 'k1', 'torch'),
    ('grpo', 'token-mean', 'zero', 2, None, 'policy', False, 0.1, 1.0, 'inverse', 1, 2, 1, False, 'sample', 'k3', 'torch'),
    ('grpo', 'token-mean', 'zero', 0, None, 'rule', False, 0.0, 1.0, 'none', 1, 2, 2, False, 'population', 'k3', 'torch'),
    ('reinforce_decay', 'seq-mean-token-mean', 'filter', 2, None, 'policy', True, 0.0, 1.0, 'exp', 1, 1, 1, True, 'population', 'k1', 'torch'),
    ('reinforce_decay', 'seq-mean-token-sum', 'zero', 2, 0.0, 'rule', False, 0.1, 0.5, 'inverse', 2, 2, 1, False, 'population', 'k3', 'torch'),
    ('reinforce_decay', 'token-mean', 'zero', 1, None, 'none', True, 0.1, 1.0, 'none', 2, 1, 2, True, 'population', 'k1', 'torch'),
    ('reinforce_decay', 'seq-mean-token-sum', 'zero', 0, None, 'none', True, 0.0, 0.5, 'none', 1, 2, 2, True, 'population', 'k1', 'torch'),
    ('rloo', 'seq-mean-token-mean', 'filter', 1, None, 'policy', True, 0.0, 1.0, 'none', 2, 1, 1, True, 'population', 'k3', 'torch'),
    ('rloo', 'seq-mean-token-sum', 'zero', 2, 0.0, 'rule', True, 0.1, 1.0, 'exp', 1, 2, 2, False, 'population', 'k1', 'torch'),
    ('rloo', 'token-mean', 'zero', 1, 0.0, 'none', False, 0.0, 0.5, 'inverse', 2, 1, 1, False, 'population', 'k1', 'torch'),
    ('rloo', 'seq-mean-token-mean', 'filter', 0, None, 'rule', False, 0.1, 1.0, 'none', 1, 1, 1, True, 'population', 'k3', 'torch'),
    ('grpo', 'seq-mean-token-mean', 'zero', 0, None, 'rule', True, 0.0, 0.5, 'none', 1, 1, 2, False, 'none', 'k3', 'torch'),
    ('gae', 'seq-mean-token-mean', 'bootstrap', 1, 0.0, 'policy', True, 0.0, 1.0, 'exp', 1, 2, 2, False, 'population', 'k1', 'torch'),
    ('grpo', 'seq-mean-token-sum', 'filter', 1, None, 'none', False, 0.0, 0.5, 'none', 1, 1, 1, True, 'sample', 'k3', 'torch'),
    ('gae', 'seq-mean-token-sum', 'bootstrap', 2, 0.0, 'rule', True, 0.0, 0.5, 'inverse', 1, 2, 1, True, 'population', 'k3', 'torch'),
    ('grpo', 'token-mean', 'filter', 2, 0.0, 'rule', True, 0.1, 0.5, 'inverse', 2, 2, 2, True, 'none', 'k1', 'torch'),
    ('grpo', 'token-mean', 'filter', 2, 0.0, 'policy', False, 0.0, 1.0, 'exp', 2, 2, 1, False, 'none', 'k3', 'torch'),
    ('grpo', 'seq-mean-token-mean', 'filter', 2, 0.0, 'rule', False, 0.1, 0.5, 'inverse', 2, 1, 1, True, 'sample', 'k3', 'torch'),
    ('grpo', 'seq-mean-token-mean', 'zero', 0, None, 'policy', False, 0.1, 0.5, 'none', 1, 2, 1, False, 'sample', 'k3', 'torch'),
    ('gae', 'seq-mean-token-mean', 'bootstrap', 0, None, 'rule', True, 0.0, 0.5, 'none', 1, 2, 1, False, 'population', 'k3', 'torch'),
    ('grpo', 'seq-mean-token-sum', 'filter', 1, 0.0, 'policy', False, 0.0, 1.0, 'exp', 2, 2, 2, True, 'sample', 'k1', 'torch'),
]]


def covered_pairs(rows: list[dict]) -> set:
    return {pair for row in rows for pair in itertools.combinations(row.items(), 2)}


def all_pairs() -> set:
    return {((a, va), (b, vb)) for a, b in itertools.combinations(FACTORS, 2) for va in FACTORS[a] for vb in FACTORS[b]}


def test_print_the_covering_table():
    short = {name: name.split(".")[1][:12] for name in FACTORS}
    print("\n" + " | ".join(["#", *short.values()]))
    for index, row in enumerate(ROWS):
        print(" | ".join([str(index), *(str(row[name]) for name in FACTORS)]))
    print("pairs left out:", sorted(all_pairs() - covered_pairs(ROWS), key=repr))


def test_every_row_validates_and_every_pair_left_out_is_refused():
    assert all(is_valid(row) for row in ROWS)
    for (a, va), (b, vb) in all_pairs() - covered_pairs(ROWS):
        pair = {a: va, b: vb}
        assert _refused_on_its_own(pair), pair


def _refused_on_its_own(pair: dict) -> bool:
    """No completion of the pair validates (e.g. gae without a value head)."""
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


def run_row(index: int, root: Path, row: dict | None = None) -> tuple[dict | None, str, float]:
    """One row's ``fit`` in its own process: (its result, the tail of its log, seconds)."""
    from tests.fitting import main

    out, log = root / f"row{index}.json", root / f"row{index}.log"
    argv = [str(out), str(root / f"row{index}"), *overrides(row or ROWS[index]),
            "--env.max_context_tokens=512", "--env.summary_max_tokens=32"]
    start = time.monotonic()
    process = _forkserver().Process(target=main, args=(argv, str(log)))
    process.start()
    process.join(RUN_TIMEOUT_S)
    timed_out = process.is_alive()
    if timed_out:
        os.kill(process.pid, signal.SIGTERM)  # the run checkpoints and exits; past a grace, SIGKILL
        process.join(15)
        if process.is_alive():
            process.kill()
            process.join()
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    if timed_out:
        return None, f"timed out after {RUN_TIMEOUT_S} s\n{tail}", time.monotonic() - start
    result = json.loads(out.read_text()) if process.exitcode == 0 and out.exists() else None
    return result, tail, time.monotonic() - start


def _forkserver():
    context = multiprocessing.get_context("forkserver")
    # imported once in the server, not once per row (most of a tiny row's cost)
    context.set_forkserver_preload(["torch", "lightning", "transformers", "lightning_agentrl.module", "tests.fitting"])
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return context


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("combinations")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda i: run_row(i, root), range(len(ROWS))))
    cpu_s = sum(result["cpu_s"] for result, _, _ in done if result is not None)
    print(f"\n{len(ROWS)} rows in {time.monotonic() - start:.0f} s ({cpu_s:.0f} CPU seconds in the rows):",
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
    check_row(ROWS[index], *results[index][:2], index)


@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_a_row_with_the_vllm_engine(tmp_path):
    """A row (GAE, KL, several updates, staleness 1, the policy's summaries) with vLLM generating every episode
    (written out: a regenerated table reorders its rows)."""
    pytest.importorskip("vllm")
    row = dict(zip(FACTORS, ('gae', 'seq-mean-token-sum', 'zero', 1, None, 'policy', True, 0.1, 1.0, 'exp', 1, 2, 2,
                             True, 'population', 'k3', 'vllm'), strict=True))
    result, output, _ = run_row(0, tmp_path, row)
    check_row(row, result, output, "vllm")


def check_row(row: dict, result: dict | None, output: str, index) -> None:
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


if __name__ == "__main__":
    rows, impossible = covering_rows()
    print("ROWS = [")
    for row in rows:
        print(f"    {tuple(row.values())!r},")
    print("]")
