"""`make bench` in one go: every benchmark one after the other, each timed, then one table of what each
measured against its target, read back from the records the scripts wrote.

    python benchmarks/suite.py                 # make bench: run them all, then the table
    python benchmarks/suite.py --only lora,compute
    python benchmarks/suite.py --only peer_trl_smollm2   # a row too long for the 30 minutes (the table shows its record)
    python benchmarks/suite.py --table-only    # the table of the records as they are, nothing run

A script that fails is reported (its exit status and last line) and the others still run; the exit status is
1 if any failed. Writes ``benchmarks/results/suite/suite.json`` (each script's seconds and exit status, the
total, and the table's rows, each naming the commit its record measured) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.record import RESULTS, write_record  # noqa: E402

OUT = RESULTS / "suite" / "suite.json"
BUDGET_S = 30 * 60  # the whole suite on 2 idle cores


@dataclass(frozen=True)
class Row:
    """One benchmark: its command and how its record reads as a figure against a target."""

    name: str
    argv: tuple[str, ...]
    record: str  # under benchmarks/results/
    target: str
    read: Callable[[dict], tuple[str, bool | None]]  # record -> (figure, met; None where there is no target)
    in_suite: bool = True  # False: longer than the suite's budget allows; run by `--only NAME`, read by the table


def _lora(d: dict) -> tuple[str, bool]:
    r = d["ratios"]
    return (f"steps {r['step_cpu_speedup']:.2f}x (CPU s), optimizer {r['optimizer_ratio']:.0f}x, "
            f"sync {r['sync_ratio']:.0f}x"), (r["step_cpu_speedup"] >= 1.3 and r["optimizer_ratio"] >= 5
                                               and r["sync_ratio"] >= 20)


def _gateway(d: dict) -> tuple[str, bool]:
    ratio = d["in_flight"]["32"]["p50_ratio"]
    return f"p50 at 32 in flight {ratio:.2f}x direct", ratio <= 1.2


def _async(d: dict) -> tuple[str, bool]:
    arm = next(a for a in d["arms"] if a["max_staleness"] == 2)
    return (f"bound 2: {arm['ratio']:.2f}x sync, {arm['share_of_ideal']:.0%} of ideal",
            arm["ratio"] >= 3 and arm["share_of_ideal"] >= 0.9)


def _engines(d: dict) -> tuple[str, None]:
    e = d["engines"]
    parts = [f"{k} {v['tokens_per_s']:.0f} tok/s" for k, v in e.items() if "tokens_per_s" in v]
    return ", ".join(parts), None


def _logprob(d: dict) -> tuple[str, bool]:
    worst = min(r["ratio"] for r in d["rows"])
    diff = max(max(r["max_abs_diff"].values()) for r in d["rows"])
    return f"{worst:.1f}x less peak (worst vocabulary), max diff {diff:.1e}", worst >= 8 and diff <= 1e-5


def _sandbox(d: dict) -> tuple[str, bool]:
    c = d["concurrent"]["ratio"]
    return f"p50 {d['ratio_p50']:.2f}x direct, concurrent {c:.2f}x", d["ratio_p50"] <= 1.3 and c >= 0.8


def _compute(d: dict) -> tuple[str, bool]:
    t, g = d["train"], d["generation"]
    return (f"train {t['fraction_of_fp32_rate']:.0%} of fp32 matmul rate; decode {g['decode_tokens_per_s']:.0f} "
            f"tok/s vs prefill {g['prefill_tokens_per_s']:.0f}"), d["meets_target"]


ROWS = (
    Row("peer_trl", ("peer_trl.py", "--threads", "1"), "peer_trl/peer_trl.json", "- (tiny model; 2x is the 135M row's)",
        lambda d: (f"{d['ratio_project_over_trl']:.2f}x TRL", None)),
    Row("peer_trl_smollm2", ("peer_trl.py", "--model", "smollm2-135m-instruct", "--threads", "1", "--rounds", "1",
                             "--warmup", "1", "--steps", "3", "--project-set", "engine.kind=vllm",
                             "--project-set", "env.max_context_tokens=256",
                             "--out", "benchmarks/results/peer_trl/peer_trl_smollm2_vllm.json"),
        "peer_trl/peer_trl_smollm2_vllm.json", ">= 2x TRL tokens/s (135M)",
        lambda d: (f"{d['ratio_project_over_trl']:.2f}x TRL" + (" (TRL side reused)" if "reused_from" in d["trl"] else ""),
                   d["ratio_project_over_trl"] >= 2 and "reused_from" not in d["trl"]),
        in_suite=False),  # about 25 minutes on 2 cores: TRL's steps alone take 2 minutes each
    Row("compute", ("compute_bench.py",), "compute/compute.json", "train >= 40% of the matmul rate", _compute),
    Row("lora", ("lora_bench.py", "--steps", "3", "--threads", "1"), "lora/lora.json",
        "steps >= 1.3x, optimizer >= 5x, sync >= 20x", _lora),
    Row("logprob_memory", ("logprob_memory_bench.py",), "logprob_memory/logprob_memory.json",
        ">= 8x less peak, <= 1e-5", _logprob),
    Row("sampling", ("sampling_bench.py", "--threads", "1"), "sampling/sampling.json", "faster than per-row",
        lambda d: (f"{d['speedup']:.2f}x per-row sampling", d["speedup"] > 1)),
    Row("packing", ("packing_bench.py",), "packing/packing.json", ">= 2x padded",
        lambda d: (f"{d['speedup']:.2f}x padded", d["speedup"] >= d["target_speedup"])),
    Row("packed_attention", ("packed_attention_bench.py",), "packed_attention/packed_attention.json",
        "cost by sum of squared lengths",
        lambda d: (", ".join(f"{r['segments']} segments {r['speedup']}x" for r in d["rows"]),
                   all(r["speedup"] > 1 for r in d["rows"]))),
    Row("shared_prefix", ("shared_prefix_bench.py", "--repeats", "1"), "shared_prefix/shared_prefix.json",
        "<= 0.75x the CPU time of whole segments",
        lambda d: (f"{d['cpu_ratio']:.2f}x the CPU time (tokens {d['token_ratio']:.2f}x)", d["cpu_ratio"] <= 0.75)),
    Row("scaling", ("scaling_bench.py",), "scaling/scaling.json", "step exponent vs tokens <= 1",
        lambda d: (f"exponent {d['exponent_step_vs_tokens']}", d["exponent_step_vs_tokens"] <= 1.1)),
    Row("async", ("async_bench.py",), "async/async.json", ">= 3x at bound 2, >= 90% of ideal", _async),
    Row("engine_compare", ("engine_compare.py",), "engine_compare/engine_compare.json", "-", _engines),
    Row("engine", ("engine_bench.py",), "engine/engine_vllm.json", "-",
        lambda d: (f"vLLM {d['tokens_per_s_median']:.0f} tok/s, weight update {d['weight_update_s_median']:.2f} s",
                   None)),
    Row("sandbox", ("sandbox_bench.py",), "sandbox/sandbox.json", "p50 <= 1.3x, concurrent >= 0.8x", _sandbox),
    Row("scoring", ("scoring_bench.py",), "scoring/scoring.json", "-",
        lambda d: (f"CPU saved {d['cpu_saved_fraction']:.0%}", None)),
    Row("http_client", ("http_client_bench.py",), "http_client/http_client.json", "-",
        lambda d: (", ".join(f"{k} {v} ms" for k, v in d["client_cpu_ms_per_request"].items()), None)),
    Row("gateway", ("gateway_bench.py",), "gateway/gateway.json", "<= 1.2x direct p50 at 32 in flight", _gateway),
    Row("gateway_smollm2", ("gateway_bench.py", "--model-path", "smollm2-135m-instruct", "--calls", "4"),
        "gateway/gateway_smollm2-135m-instruct.json", "<= 1.2x direct p50 at 32 in flight", _gateway),
)


def run(row: Row) -> dict:
    """Run one benchmark script; its seconds, exit status and last output line."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / row.argv[0]), *row.argv[1:]], cwd=REPO,
                          capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    print(f"{row.name}: {time.perf_counter() - started:.0f} s, exit {done.returncode}", flush=True)
    return {"seconds": round(time.perf_counter() - started, 1), "returncode": done.returncode,
            "last_line": lines[-1][:300] if lines else ""}


def table_row(row: Row) -> dict:
    """What the row's record says now (figure, target, met, commit), or that it has none; a row the suite does not
    run says so in its figure."""
    path = RESULTS / row.record
    own = "" if row.in_suite else f" [own command: suite.py --only {row.name}]"
    if not path.exists():
        return {"benchmark": row.name, "figure": "no record" + own, "target": row.target, "met": None, "commit": "-"}
    record: object = None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise TypeError(f"a JSON {type(record).__name__}, not an object")
        figure, met = row.read(record)
    except (OSError, KeyError, StopIteration, TypeError, ValueError, AttributeError) as err:  # broken or older layout
        figure, met = f"unreadable record ({type(err).__name__}: {err})", None
    record = record if isinstance(record, dict) else {}
    commit = str(record.get("commit") or "?") + (" (dirty)" if record.get("dirty") else "")
    figure += own
    return {"benchmark": row.name, "figure": figure, "target": row.target, "met": met, "commit": commit}


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table("benchmark", "figure", "target", "met", "commit")
    for r in rows:
        table.add_row(r["benchmark"], escape(r["figure"]), escape(r["target"]), {True: "yes", False: "no", None: "-"}[r["met"]],
                      r["commit"])
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--table-only", action="store_true", help="print the table of the records; run nothing")
    args = parser.parse_args(argv)
    names = {r.name for r in ROWS}
    chosen = args.only.split(",") if args.only is not None else sorted(r.name for r in ROWS if r.in_suite)
    if unknown := set(chosen) - names:
        parser.error(f"--only: unknown benchmark(s) {sorted(unknown)}; known: {sorted(names)}")
    rows = [r for r in ROWS if r.name in chosen]
    runs = {} if args.table_only else {r.name: run(r) for r in rows}
    # the whole table either way: rows too long for the suite show their last record
    table = [table_row(r) for r in (rows if args.only is not None else ROWS)]
    print_table(table)
    if not args.table_only:
        total = sum(r["seconds"] for r in runs.values())
        print(f"suite: {len(runs)} benchmarks in {total / 60:.1f} min (budget {BUDGET_S // 60} min on 2 idle cores), "
              f"load {os.getloadavg()[0]:.1f}")
        write_record(OUT if not args.only else OUT.with_name("suite_partial.json"),
                     {"runs": runs, "total_s": total, "budget_s": BUDGET_S, "within_budget": total <= BUDGET_S,
                      "load_average": os.getloadavg(), "table": table}, config=None, overrides=None, seed=None)
    return 1 if any(r["returncode"] for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
