"""The hidden check's cost: one ``score_submission`` of a solved copy-the-key task, end to end.

    python benchmarks/scoring_bench.py [--rounds 30] [--out benchmarks/results/scoring/scoring.json]

Each round scores the same submission twice, in alternating order so both see the same load: once
as scoring runs (``lazy_peer``: the peer starts at the judge's first request, and this task's
hidden script, which only reads ``answer.txt``, never makes one), and once with the peer started
with the judge (``lazy_peer`` off, as scoring ran before), which measures what the lazy peer saves.
A round is the fork of the agent's sandbox, the judge (and the peer) and their launcher under the
service's isolation, and the delete; a round that does not score 1 stops the benchmark. Writes
``--out`` and prints one summary line; run it on an idle machine (the CPU column counts every
process on it).

It also measures the two Python starts a check makes, each alone (``starts_cpu_ms``: CPU of
``--rounds`` starts as children of this process, the mean): the judge's interpreter (``python -I``,
whose ``site`` runs the venv's .pth files: an editable install's import hook costs every start),
the same with ``-S`` (no .pth at all, the floor), the pair launcher's imports (the top-level ones
of ``sandbox_server/pair_launch.py``, read from it) against reading its spec with ``json`` instead
of ``binascii`` and ``marshal`` and against adding ``signal`` (which it imported before: ``enum``
comes with it), and the judge's own imports (the top-level ones of
``sandbox_client/score_runner.py``) against the same plus ``shutil`` and ``tempfile``, which it
imported before.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.record import write_record  # noqa: E402
from lightning_agentrl.tasks import load_tasks  # noqa: E402
from sandbox_client import SandboxClient, scoring  # noqa: E402
from sandbox_server.launch import start_local_server  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "scoring" / "scoring.json"
FLAVOURS = ("lazy_peer", "eager_peer")


class _EagerPeerClient(SandboxClient):
    """Scoring as it ran before the lazy peer: every exec starts its peer with the command."""

    async def exec(self, *args, **kwargs):
        return await super().exec(*args, **{**kwargs, "lazy_peer": False})


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, every process: the scoring's
    processes are not this one's children), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


async def _one(client: SandboxClient, task, sandbox_id: str, flavour: str) -> tuple[float, float]:
    busy = _busy_s()
    start = time.perf_counter()
    result = await scoring.score_submission(
        client, task_files=dict(task.files), hidden_files=dict(task.hidden_files), agent_sandbox_id=sandbox_id,
        test_command=task.hidden_test_command, timeout_s=60, required_passed=task.hidden_test_count)
    elapsed, cpu = time.perf_counter() - start, _busy_s() - busy
    if result.reward != 1.0:
        raise RuntimeError(f"{flavour}: the solved task scored {result.reward}: {result.output[-500:]}")
    return elapsed, cpu


async def measure(url: str, token: str, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall seconds, machine CPU seconds) of each scoring, per flavour."""
    task = load_tasks(REPO / "tasks" / "learn", split="train")[0]
    times: dict[str, list[float]] = {name: [] for name in FLAVOURS}
    cpu: dict[str, list[float]] = {name: [] for name in FLAVOURS}
    async with SandboxClient(url, token) as lazy, _EagerPeerClient(url, token) as eager:
        clients = {"lazy_peer": lazy, "eager_peer": eager}
        sandbox_id = await lazy.create(dict(task.files))
        await lazy.write_file(sandbox_id, "answer.txt", task.files["key.txt"])
        for name in FLAVOURS:  # warm the page cache for both
            await _one(clients[name], task, sandbox_id, name)
        for index in range(rounds):
            order = list(FLAVOURS) if index % 2 == 0 else list(reversed(FLAVOURS))
            for name in order:
                elapsed, busy = await _one(clients[name], task, sandbox_id, name)
                times[name].append(elapsed)
                cpu[name].append(busy)
        await lazy.delete(sandbox_id)
    return times, cpu


def _top_level_imports(path: Path) -> list[str]:
    """The modules a source imports at its top level (``import x`` lines), as it starts."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]


_JUDGE_IMPORTS = "import " + ", ".join(_top_level_imports(REPO / "sandbox_client" / "score_runner.py"))
_LAUNCHER = _top_level_imports(REPO / "sandbox_server" / "pair_launch.py")
_LAUNCHER_IMPORTS = "import " + ", ".join(_LAUNCHER)
STARTS = {
    "judge_python_-I": ["-I", "-c", "pass"],
    "python_-I_-S": ["-I", "-S", "-c", "pass"],
    "launcher_marshal": ["-I", "-S", "-c", _LAUNCHER_IMPORTS],
    "launcher_json": ["-I", "-S", "-c", "import " + ", ".join(m for m in _LAUNCHER if m not in ("binascii", "marshal"))
                      + ", json"],
    "launcher_marshal_signal": ["-I", "-S", "-c", _LAUNCHER_IMPORTS + ", signal"],
    "judge_imports": ["-I", "-B", "-c", _JUDGE_IMPORTS],
    "judge_imports_before": ["-I", "-B", "-c", _JUDGE_IMPORTS + ", shutil, tempfile"],
}


def start_cpu_ms(rounds: int) -> dict[str, float]:
    """Mean CPU milliseconds (user + system) of one start of each of :data:`STARTS`, in alternating order."""
    spent = {name: 0.0 for name in STARTS}
    for _ in range(rounds):
        for name, args in STARTS.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, *args], check=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            spent[name] += (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {name: round(total / rounds * 1e3, 2) for name, total in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    load_before = os.getloadavg()[0]  # not idle when this is near or above the core count
    with start_local_server() as server:
        backend = server.health()["isolation"]["backend"]
        times, cpu = asyncio.run(measure(server.url, server.token, args.rounds))
    medians = {name: statistics.median(values) for name, values in times.items()}
    cpu_means = {name: statistics.fmean(values) for name, values in cpu.items()}
    result = {
        "command": " ".join(["python", "benchmarks/scoring_bench.py", *sys.argv[1:]]),
        "task": "tasks/learn, first train task, solved",
        "backend": backend,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "load_average_1m_before": load_before,
        "median_s": medians,
        "min_s": {name: min(values) for name, values in times.items()},
        "saved_fraction": 1 - medians["lazy_peer"] / medians["eager_peer"],
        # the machine's busy CPU seconds during each scoring, averaged (the judge and the peer start at
        # once, so the wall time shows the slower of the two; 32 scorings at once share the cores)
        "cpu_s_mean": cpu_means,
        "cpu_saved_fraction": 1 - cpu_means["lazy_peer"] / cpu_means["eager_peer"],
        "starts_cpu_ms": start_cpu_ms(args.rounds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_record(args.out, result, config=None, overrides=None, seed=None)
    print(f"scoring ({backend}): median {medians['lazy_peer'] * 1e3:.0f} ms with the lazy peer vs "
          f"{medians['eager_peer'] * 1e3:.0f} ms with the peer started with the judge ({result['saved_fraction']:.0%} "
          f"less); CPU {cpu_means['lazy_peer'] * 1e3:.0f} vs {cpu_means['eager_peer'] * 1e3:.0f} ms "
          f"({result['cpu_saved_fraction']:.0%} less), {args.rounds} rounds, load {load_before:.1f} before")
    print("CPU of one start (ms): " + ", ".join(f"{name} {ms}" for name, ms in result["starts_cpu_ms"].items()))

if __name__ == "__main__":
    main()
