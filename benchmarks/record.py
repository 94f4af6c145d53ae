"""Where every benchmark record comes from: each script writes its JSON through ``write_record``, which
stamps the commit it measured, whether the tree had uncommitted changes, the command, and the machine's
load, so a figure in the docs can be traced to the code and the conditions that produced it."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Every record carries these (tests/test_benchmarks.py checks the records under benchmarks/results/).
PROVENANCE_KEYS = ("commit", "dirty", "command", "load_avg_1min", "cpus", "written_at")


def _git(*argv: str) -> str:
    done = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=30)
    return done.stdout.strip() if done.returncode == 0 else ""


def provenance(argv: list[str] | None = None) -> dict:
    """The commit (short hash; ``unknown`` outside a git checkout), ``dirty`` (tracked files differ from
    it: the figure may not be the commit's), the command as typed, the 1-minute load average and the
    core count (a ratio measured on a busy machine misleads), and the UTC time of writing."""
    argv = sys.argv if argv is None else argv
    return {
        "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "command": shlex.join(["python", *argv]),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "written_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_record(path: Path | str, record: dict, argv: list[str] | None = None) -> dict:
    """Write ``record`` as JSON to ``path`` with its provenance first (a key the record already sets, such
    as its own ``command``, wins). Written to a temporary file then renamed: an interrupted benchmark
    never leaves half a record."""
    path = Path(path)
    stamped = {**provenance(argv), **record}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(stamped, indent=2) + "\n")
    tmp.replace(path)
    return stamped
