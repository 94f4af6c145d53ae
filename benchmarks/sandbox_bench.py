"""Sandbox service overhead: exec round-trip on loopback vs a direct subprocess call, and throughput.

    python benchmarks/sandbox_bench.py [--rounds 50]

Writes benchmarks/results/sandbox.json and prints one summary line. The ratio (p50 through the
service / p50 of subprocess.run of the same command) is the number to watch; absolute times depend
on the host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sandbox_client import SandboxClient
from sandbox_server.launch import start_local_server

COMMAND = ["python", "-c", "print('ok')"]
RESULTS = Path(__file__).resolve().parent / "results" / "sandbox.json"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def direct_latencies(rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        subprocess.run([sys.executable, *COMMAND[1:]], capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return times


async def service_latencies(client: SandboxClient, rounds: int) -> list[float]:
    sid = await client.create({})
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        await client.exec(sid, COMMAND)
        times.append(time.perf_counter() - start)
    await client.delete(sid)
    return times


async def throughput(client: SandboxClient, num_sandboxes: int, execs_each: int) -> float:
    ids = await asyncio.gather(*(client.create({}) for _ in range(num_sandboxes)))

    async def work(sid: str) -> None:
        for _ in range(execs_each):
            await client.exec(sid, COMMAND, timeout_s=120)

    start = time.perf_counter()
    await asyncio.gather(*(work(sid) for sid in ids))
    elapsed = time.perf_counter() - start
    await asyncio.gather(*(client.delete(sid) for sid in ids))
    return num_sandboxes * execs_each / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--execs-per-sandbox", type=int, default=4)
    args = parser.parse_args()
    direct = direct_latencies(args.rounds)
    with start_local_server(max_sandboxes=128) as server:
        backend = server.health()["isolation"]["backend"]

        async def run() -> tuple[list[float], dict[str, float]]:
            async with SandboxClient(server.url, server.token, timeout_s=120, max_connections=64) as client:
                latencies = await service_latencies(client, args.rounds)
                rates = {str(n): await throughput(client, n, args.execs_per_sandbox) for n in (1, 8, 64)}
                return latencies, rates

        latencies, rates = asyncio.run(run())
    result = {
        "command": COMMAND,
        "backend": backend,
        "rounds": args.rounds,
        "direct_p50_s": statistics.median(direct),
        "direct_p99_s": _percentile(direct, 0.99),
        "service_p50_s": statistics.median(latencies),
        "service_p99_s": _percentile(latencies, 0.99),
        "ratio_p50": statistics.median(latencies) / statistics.median(direct),
        "ratio_p99": _percentile(latencies, 0.99) / _percentile(direct, 0.99),
        "throughput_execs_per_s": rates,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"sandbox ({backend}): exec p50 {result['service_p50_s'] * 1e3:.1f} ms vs direct "
          f"{result['direct_p50_s'] * 1e3:.1f} ms (x{result['ratio_p50']:.2f}), p99 x{result['ratio_p99']:.2f}; "
          f"throughput 1/8/64 sandboxes: {rates['1']:.0f}/{rates['8']:.0f}/{rates['64']:.0f} execs/s")


if __name__ == "__main__":
    main()
