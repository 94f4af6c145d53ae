"""The sandbox client's own CPU per request, with many requests in flight (as a rollout makes them).

    python benchmarks/http_client_bench.py [--in-flight 32] [--rounds 20] [--out benchmarks/results/http_client/http_client.json]

``--in-flight`` sandboxes of the reference service on loopback each read one small file ``--rounds``
times in a row, all of them at once; the measure is this process's CPU time (``time.process_time``)
over the requests, after one warm-up pass. Flavours, each with a pool of 64 connections (the
client's default):

- ``sandbox_client``: :class:`~sandbox_client.SandboxClient` as the rollout uses it (httpx2);
- ``httpx2`` and ``httpx``: the same GET with a bare ``AsyncClient`` of each library, so the
  difference is the libraries' alone. httpx 0.28 (httpcore 1.0.9) scans its whole pool, and for
  each idle connection counts the idle ones again, on every request and response: its cost grows
  with the square of the connections in use. Skipped where httpx is not installed.

Writes ``--out`` and prints one line; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.record import write_record  # noqa: E402
from sandbox_client import SandboxClient  # noqa: E402
from sandbox_server.launch import start_local_server  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "http_client" / "http_client.json"
CONNECTIONS = 64


async def _cpu_per_request(read, sandboxes: list[str], rounds: int) -> float:
    """This process's CPU seconds per call of ``read(sandbox)``, every sandbox at once."""
    async def reader(sandbox: str) -> None:
        for _ in range(rounds):
            await read(sandbox)

    await asyncio.gather(*(reader(s) for s in sandboxes))  # warm: every connection open
    start = time.process_time()
    await asyncio.gather(*(reader(s) for s in sandboxes))
    return (time.process_time() - start) / (len(sandboxes) * rounds)


async def measure(url: str, token: str, in_flight: int, rounds: int) -> dict[str, float]:
    results: dict[str, float] = {}
    async with SandboxClient(url, token, max_connections=CONNECTIONS) as client:
        sandboxes = [await client.create({"a.txt": "x" * 100}) for _ in range(in_flight)]
        results["sandbox_client"] = await _cpu_per_request(lambda s: client.read_file(s, "a.txt"), sandboxes, rounds)
        for name in ("httpx2", "httpx"):
            try:
                library = importlib.import_module(name)
            except ImportError:
                continue
            limits = library.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
            async with library.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"},
                                           limits=limits) as bare:
                async def read(sandbox: str, bare=bare) -> None:
                    response = await bare.get(f"/v1/sandboxes/{sandbox}/file", params={"path": "a.txt"})
                    response.raise_for_status()

                results[name] = await _cpu_per_request(read, sandboxes, rounds)
        for sandbox in sandboxes:
            await client.delete(sandbox)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.in_flight < 1 or args.rounds < 1:
        parser.error("--in-flight and --rounds must be at least 1")
    load_before = os.getloadavg()[0]
    with start_local_server() as server:
        cpu = asyncio.run(measure(server.url, server.token, args.in_flight, args.rounds))
    result = {
        "command": " ".join(["python", "benchmarks/http_client_bench.py", *sys.argv[1:]]),
        "in_flight": args.in_flight,
        "rounds": args.rounds,
        "connections": CONNECTIONS,
        "load_average_1m_before": load_before,
        "client_cpu_ms_per_request": {name: round(seconds * 1e3, 3) for name, seconds in cpu.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_record(args.out, result, config=None, overrides=None, seed=None)
    print("client CPU per request, " + ", ".join(f"{k} {v:.2f} ms" for k, v in
                                                 result["client_cpu_ms_per_request"].items())
          + f"; {args.in_flight} in flight, load {load_before:.1f} before")


if __name__ == "__main__":
    main()
