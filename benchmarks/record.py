"""Where every benchmark record comes from: each script writes its JSON through ``write_record``, which
stamps the commit it measured, whether the tree had uncommitted changes, the command, the config, settings
overrides and seed its runs used, and the machine's load, so a figure in the docs can be traced to the code and
the conditions that produced it. Records are filed by benchmark: ``benchmarks/results/<benchmark>/``, where
``<benchmark>`` is the script's name without ``_bench`` (``scripts/gpu_smoke.py`` files under ``gpu/``)."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# Every record written through write_record carries these (tests/test_benchmarks.py checks the records under
# benchmarks/results/): the machine's side, stamped here, and the run's side, stated by each benchmark.
PROVENANCE_KEYS = ("commit", "dirty", "command", "load_avg_1min", "cpus", "written_at")
RUN_KEYS = ("config", "overrides", "seed")


def _git(*argv: str) -> str:
    done = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=30)
    return done.stdout.strip() if done.returncode == 0 else ""


def provenance(argv: list[str] | None = None) -> dict:
    """The commit (short hash; ``unknown`` outside a git checkout), ``dirty`` (tracked files other than the records
    under benchmarks/results differ from it: the figure may not be the commit's; `make bench` rewrites records
    one after another), the command as typed, the 1-minute load average and the
    core count (a ratio measured on a busy machine misleads), and the UTC time of writing."""
    argv = sys.argv if argv is None else argv
    return {
        "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")),
        "command": shlex.join(["python", *argv]),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "written_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def shared_overrides(runs: Sequence[Sequence[str]]) -> list[str]:
    """The settings overrides every run of a record passes, in the first run's order (each run's own stay
    with the run)."""
    return [o for o in runs[0] if all(o in run for run in runs[1:])] if runs else []


def write_record(path: Path | str, record: dict, argv: list[str] | None = None, *, config: str | None,
                 overrides: Sequence[str] | dict | None, seed: int | Sequence[int] | None) -> dict:
    """Write ``record`` as JSON to ``path`` with its provenance first (a key the record already sets, such
    as its own ``command``, wins). Each benchmark states what its runs used, ``None`` where it does not
    apply: ``config``, the YAML config its runs load (``None``: the settings' defaults, no settings at all,
    or each part of the record names its own); ``overrides``, the settings overrides on top of it
    (``--section.key=value`` strings, or the nested dict ``load_settings`` takes; with several runs, those
    they all share, each run keeping its own; ``None``: it runs neither ``fit`` nor ``evaluate``, or each
    part names its own); ``seed``, the seed or seeds it sets (``None``: it sets none; the config's own
    applies, and any other draw is fixed in the script). Written to a temporary file then renamed: an
    interrupted benchmark never leaves half a record."""
    path = Path(path)
    stated = {"config": config, "overrides": overrides if overrides is None or isinstance(overrides, dict) else list(overrides),
              "seed": seed if seed is None or isinstance(seed, int) else list(seed)}
    stamped = {**provenance(argv), **stated, **record}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(stamped, indent=2) + "\n")
    tmp.replace(path)
    return stamped
