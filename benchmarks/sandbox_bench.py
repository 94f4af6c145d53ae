"""Sandbox service overhead: exec round trip of `echo hi` through the service vs the same command
started directly with the same bubblewrap flags and limits, sequentially and at 16 sandboxes at once.

    python benchmarks/sandbox_bench.py [--rounds 100] [--sandboxes 16] [--execs-per-sandbox 20]

The direct run uses the server's own ``Isolation`` to build the command (bwrap options in a memfd,
setpriv, rlimits, cgroup) and starts it the same fast way (vfork, limits given while bwrap's child
waits on --block-fd), synchronously: the difference is what the service adds (HTTP, JSON, asyncio,
output capture), not interpreter start-up (``echo hi`` takes ~1 ms; ``python -c`` would hide the overhead).
Writes benchmarks/results/sandbox/sandbox.json and prints one summary line; run it on an idle machine.
Targets (issue 13): p50 ratio <= 1.3, concurrent throughput ratio >= 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.record import write_record
from sandbox_client import SandboxClient
from sandbox_server.isolation import Isolation, _args_file, _limit_process
from sandbox_server.launch import start_local_server
from sandbox_server.limits import Cgroups
from sandbox_server.options import ServerOptions

COMMAND = ["echo", "hi"]
RESULTS = Path(__file__).resolve().parent / "results" / "sandbox" / "sandbox.json"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class DirectRunner:
    """Runs COMMAND exactly as the server would (same Isolation, flags, limits), without the service."""

    def __init__(self, num_slots: int) -> None:
        self.options = ServerOptions(token="unused", max_sandboxes=num_slots)
        self.root = Path(tempfile.mkdtemp(prefix="bench-direct-"))
        self.root.chmod(0o711)
        probe = self.root / "probe"
        probe.mkdir(mode=0o755)
        self.cgroups, _ = Cgroups.detect(self.root, self.options.max_processes, self.options.memory_bytes)
        self.isolation = Isolation(self.options, probe, self.cgroups)
        self.workspaces = []
        for slot in range(num_slots):
            workspace = self.root / f"ws{slot}"
            workspace.mkdir()
            owner = self.isolation.owner(slot)
            if owner is not None:
                os.chown(workspace, owner, owner)
            if self.cgroups is not None:
                self.cgroups.create(f"slot{slot}")
            self.workspaces.append(workspace)

    def run(self, slot: int) -> float:
        """One `echo hi` started the fastest way with the server's flags and limits: bwrap by vfork, its
        child given the rlimits and the cgroup while it waits on --block-fd (as the server does), all
        synchronous, with no HTTP, JSON or event loop."""
        workspace = self.workspaces[slot]
        uid = self.isolation.command_uid(slot)
        launch = self.isolation.launch(workspace, COMMAND, self.isolation.base_env(workspace), False, uid)
        procs = self.cgroups.procs_files(f"slot{slot}") if self.cgroups is not None else []
        start = time.perf_counter()
        info_read, info_write = os.pipe()
        block_read, block_write = os.pipe()
        args = [*launch.bwrap_args, "--info-fd", str(info_write), "--block-fd", str(block_read)]
        with _args_file(args, launch.seccomp) as fds:
            proc = subprocess.Popen(launch.host_argv(fds), cwd=workspace, env=launch.env, start_new_session=True,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(*fds, info_write, block_read))
        os.close(info_write)
        os.close(block_read)
        info = b""
        while not info.rstrip().endswith(b"}"):
            chunk = os.read(info_read, 4096)
            if not chunk:
                break
            info += chunk
        os.close(info_read)
        _limit_process(json.loads(info)["child-pid"], self.isolation.limits, procs)
        os.write(block_write, b"1")
        os.close(block_write)
        out, _ = proc.communicate()
        elapsed = time.perf_counter() - start
        assert out == b"hi\n", out
        return elapsed

    def close(self) -> None:
        if self.cgroups is not None:
            for slot in range(len(self.workspaces)):
                self.cgroups.remove(f"slot{slot}")
        subprocess.run(["rm", "-rf", str(self.root)], check=False)


def direct_throughput(runner: DirectRunner, num_sandboxes: int, execs_each: int) -> float:
    def work(slot: int) -> None:
        for _ in range(execs_each):
            runner.run(slot)

    start = time.perf_counter()
    with ThreadPoolExecutor(num_sandboxes) as pool:
        list(pool.map(work, range(num_sandboxes)))
    return num_sandboxes * execs_each / (time.perf_counter() - start)


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
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--sandboxes", type=int, default=16)
    parser.add_argument("--execs-per-sandbox", type=int, default=20)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]  # not idle when this is near or above the core count
    runner = DirectRunner(args.sandboxes)
    try:
        runner.run(0)  # warm caches
        direct = [runner.run(0) for _ in range(args.rounds)]
        direct_rate = direct_throughput(runner, args.sandboxes, args.execs_per_sandbox)
    finally:
        runner.close()
    with start_local_server(max_sandboxes=max(32, 2 * args.sandboxes)) as server:
        backend = server.health()["isolation"]["backend"]

        async def run() -> tuple[list[float], float]:
            async with SandboxClient(server.url, server.token, timeout_s=120, max_connections=64) as client:
                latencies = await service_latencies(client, args.rounds)
                rate = await throughput(client, args.sandboxes, args.execs_per_sandbox)
                return latencies, rate

        latencies, service_rate = asyncio.run(run())
    result = {
        "command": COMMAND,
        "backend": backend,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "load_average_1m_before": load_before,
        "direct_p50_s": statistics.median(direct),
        "direct_p95_s": _percentile(direct, 0.95),
        "service_p50_s": statistics.median(latencies),
        "service_p95_s": _percentile(latencies, 0.95),
        "ratio_p50": statistics.median(latencies) / statistics.median(direct),
        "ratio_p95": _percentile(latencies, 0.95) / _percentile(direct, 0.95),
        "concurrent": {"sandboxes": args.sandboxes, "execs_per_sandbox": args.execs_per_sandbox,
                       "direct_execs_per_s": direct_rate, "service_execs_per_s": service_rate,
                       "ratio": service_rate / direct_rate},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    write_record(RESULTS, result, config=None, overrides=None, seed=None)
    print(f"sandbox ({backend}): exec of `echo hi` p50 {result['service_p50_s'] * 1e3:.1f} ms vs direct "
          f"{result['direct_p50_s'] * 1e3:.1f} ms (x{result['ratio_p50']:.2f}), p95 x{result['ratio_p95']:.2f}; "
          f"{args.sandboxes} sandboxes x {args.execs_per_sandbox} execs: {service_rate:.0f} vs {direct_rate:.0f} "
          f"execs/s (x{result['concurrent']['ratio']:.2f})")


if __name__ == "__main__":
    main()
