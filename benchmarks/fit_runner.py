"""One ``fit`` run in its own subprocess, timed per step: the shared runner of the async and scaling benchmarks.

    python benchmarks/fit_runner.py --out steps.json -- --rollout.max_staleness=2 ...

The child trains with the given settings overrides and the peer benchmark's stage clock
(``benchmarks.peer_trl.stage_clock``: per step the time between steps, the train phase, backward,
optimizer, tokens and episode timings) and writes the steps as JSON. :func:`run_fit` starts it,
with ``threads`` torch threads, and adds the wall time and the load average around the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO / ".cache" / "lightning_agentrl"


def run_fit(overrides: list[str], *, threads: int = 2) -> dict:
    """Steps of one ``fit`` run (see the module docstring), with ``wall_s`` and ``load_avg_1min``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        started, load_before = time.perf_counter(), os.getloadavg()[0]
        done = subprocess.run([sys.executable, __file__, "--out", str(out), "--", *overrides, f"--trainer.threads={threads}"],
                              cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"fit failed ({' '.join(overrides)}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        steps = json.loads(out.read_text())
    return {"steps": steps, "wall_s": round(time.perf_counter() - started, 1),
            "load_avg_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}}


def step_seconds(steps: list[dict], warmup: int) -> list[float]:
    """Durations between consecutive step ends, the first ``warmup`` steps left out."""
    ends = [s["end"] for s in steps]
    return [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:], strict=False)]


def median_of(steps: list[dict], key: str, warmup: int) -> float:
    return statistics.median(s[key] for s in steps[warmup:])


def base_overrides(run_dir: Path, tasks: Path, *, max_steps: int, seed: int = 0) -> list[str]:
    """Settings every benchmark run shares: the tiny model, the torch engine, the latency environment."""
    return [f"--run.dir={run_dir}", f"--run.seed={seed}", "--model.path=tiny", f"--model.cache_dir={CACHE_DIR}",
            "--engine.kind=torch", "--env.kind=benchmarks.latency_env:LatencyEnv", f"--env.tasks={tasks}",
            f"--trainer.max_steps={max_steps}", "--tracking.experiment=bench"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks.peer_trl import stage_clock
    from lightning_agentrl.settings import load_settings
    from lightning_agentrl.train import fit

    clock = stage_clock()
    fit(load_settings(None, args.overrides), callbacks=[clock])
    Path(args.out).write_text(json.dumps(clock.steps))


if __name__ == "__main__":
    main()
