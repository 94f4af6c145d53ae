"""What the OpenAI-compatible gateway adds to a call: latency per call through it against the engine called
directly, on the same prompts, at 1 and at 32 episodes in flight.

    python benchmarks/gateway_bench.py [--in-flight 1 32] [--calls 8] [--tokens 16] [--out benchmarks/results/gateway/gateway.json]
    python benchmarks/gateway_bench.py --model-path smollm2-135m-instruct   # gateway_smollm2-135m-instruct.json

Both arms run the torch engine (``--model-path``: the tiny model, or a real one, where a user's engine cost
is; ``--admission-window-ms``: its ``engine.admission_window_ms``) in one event loop. ``direct``: each episode renders its
conversation with the chat codec and calls ``engine.generate`` ``--calls`` times. ``gateway``: each episode
is an agent with the real `openai` client (``AsyncOpenAI``, all agents in one client process of their own, as
agents are not the trainer) calling its own gateway URL with the same messages; the gateway renders the same ids, and each request carries the seed the direct arm used
(``request_seed`` of the same run seed, episode id and call index), so both arms sample the same tokens
and the difference is the gateway's: HTTP on loopback, JSON, rendering, the reply's decoding and parsing.
Each arm's calls run in ``--parts`` parts, the arms alternating, so that other work starting or ending on the
machine mid-run weighs on both.
Writes ``--out`` (p50 and p99 of each arm, their ratios, each arm's prefills, decode steps and CPU per call, the
agents' CPU apart, and the ratio that CPU alone sets: on 2 cores, every arm of the tiny model is CPU-bound) and
prints one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.record import write_record

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results" / "gateway" / "gateway.json"


def _episode_id(index: int, part: int) -> str:
    return f"b{index}.{part}"


def _conversation(episode: int, call: int) -> list[dict]:
    return [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": f"Task {episode}, step {call}: read the file and say what it does."}]


@dataclass
class _Tally:
    """One arm over its parts: each call's latency, the engine's prefills and decode steps, and this process's CPU
    time (all its threads: the event loop, the engine's decode thread), which unlike latency barely moves with
    other processes' load."""

    seconds: list[float] = field(default_factory=list)
    prefills: int = 0
    steps: int = 0
    cpu_s: float = 0.0

    @contextlib.contextmanager
    def counting(self, engine):
        prefills, steps, cpu = engine.num_batches, engine.num_steps, time.process_time()
        yield
        self.prefills += engine.num_batches - prefills
        self.steps += engine.num_steps - steps
        self.cpu_s += time.process_time() - cpu

    def summary(self, num_calls: int) -> dict:
        return {**_quantiles(self.seconds), "engine_prefills": self.prefills, "engine_steps": self.steps,
                "cpu_ms_per_call": 1000 * self.cpu_s / num_calls}


def _quantiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50_ms": 1000 * statistics.median(ordered), "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "calls": len(ordered)}


async def _direct(engine, codec, sampling, in_flight: int, calls: int, part: int = 0) -> list[float]:
    from dataclasses import replace

    from lightning_agentrl.rollout.agent_loop import request_seed

    async def episode(index: int) -> list[float]:
        latencies = []
        for call in range(calls):
            t0 = time.perf_counter()
            ids = codec.prompt_ids(_conversation(index, part * calls + call))
            # the seed the gateway gives the same call of the same episode (its id, its call index)
            request = replace(sampling, seed=request_seed(sampling.seed, _episode_id(index, part), call))
            await engine.generate(ids, request, _episode_id(index, part))
            latencies.append(time.perf_counter() - t0)
        return latencies

    return [s for episode_seconds in await asyncio.gather(*(episode(i) for i in range(in_flight))) for s in episode_seconds]


class _WaitingAgent:
    """Stands for one episode's agent in this process: hands its URL and key to the client process, then waits
    for it to finish (the client's CPU is the agent's, not the gateway's: it runs in a process of its own)."""

    def __init__(self, index: int, handed: asyncio.Queue, finished: asyncio.Event) -> None:
        self.index, self.handed, self.finished = index, handed, finished

    async def run_agent(self, base_url: str, api_key: str) -> float:
        await self.handed.put([self.index, base_url, api_key])
        await self.finished.wait()
        return 0.0

    async def close(self) -> None:
        return None


def _timed(app, seconds: list[float]):
    """``app`` (ASGI) timed from a request's arrival to its reply's last byte: the call as the gateway serves it,
    without the client library's own time (building, sending and parsing on the agent's side)."""

    async def timed(scope, receive, send):
        t0 = time.perf_counter()

        async def sent(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                seconds.append(time.perf_counter() - t0)

        await app(scope, receive, sent)

    return timed


async def _through_gateway(gateway, engine, codec, sampling, budget, in_flight: int, calls: int, part: int = 0) -> dict:
    handed, finished = asyncio.Queue(), asyncio.Event()
    plays = [asyncio.create_task(gateway.play(
        engine=engine, env=_WaitingAgent(i, handed, finished), codec=codec, sampling=sampling, budget=budget,
        episode_id=_episode_id(i, part), task_id="bench", group_id=0)) for i in range(in_flight)]
    episodes = [await handed.get() for _ in range(in_flight)]
    client = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    out, _ = await client.communicate(json.dumps({"episodes": episodes, "calls": calls, "first_call": part * calls,
                                                  "tokens": sampling.max_new_tokens}).encode())
    finished.set()
    await asyncio.gather(*plays)
    if client.returncode != 0:
        raise RuntimeError(f"the client process failed with status {client.returncode}")
    return json.loads(out)


async def _client(plan: dict) -> dict:
    """The client process: every episode's agent at once, each call timed from the `openai` client's side."""
    from openai import AsyncOpenAI

    # each agent's client is made before any call, as an agent makes it before its episode: building one
    # (an SSL context, ~40 ms of CPU) is the agent's start-up, not a call's latency
    clients = [AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) for _, base_url, api_key in plan["episodes"]]
    ready = asyncio.Barrier(len(clients))

    async def agent(index: int, client) -> list[float]:
        latencies = []
        await ready.wait()  # all start together, as the direct arm's episodes do
        for call in range(plan["calls"]):
            t0 = time.perf_counter()
            await client.chat.completions.create(model="policy", messages=_conversation(index, plan["first_call"] + call),
                                                 max_tokens=plan["tokens"])
            latencies.append(time.perf_counter() - t0)
        await client.close()
        return latencies

    cpu = time.process_time()
    per_agent = await asyncio.gather(*(agent(episode[0], client) for episode, client in zip(plan["episodes"], clients, strict=True)))
    return {"seconds": [s for latencies in per_agent for s in latencies], "cpu_s": time.process_time() - cpu}


def cpu_bound_ratio(direct: dict, through: dict) -> dict[str, float]:
    """The p50 ratio CPU alone sets when every arm is CPU-bound: a call through the gateway costs the trainer's
    process ``g`` ms and the agents' ``c`` ms, a direct call ``d`` ms. With a core each the busier process sets
    the pace, ``max(g, c) / d``; on one core (the other busy with other work) they take turns, ``(g + c) / d``.

    >>> cpu_bound_ratio({"cpu_ms_per_call": 3.0}, {"cpu_ms_per_call": 4.5, "client_cpu_ms_per_call": 1.5})
    {'core_each': 1.5, 'one_core': 2.0}
    """
    d, g, c = direct["cpu_ms_per_call"], through["cpu_ms_per_call"], through["client_cpu_ms_per_call"]
    return {"core_each": max(g, c) / d, "one_core": (g + c) / d}


def note(record: dict) -> str:
    """What the most episodes in flight cost in CPU, and the ratio that CPU alone sets against the one measured."""
    k = max(record["in_flight"], key=int)
    row = record["in_flight"][k]
    d, g = row["direct"], row["gateway"]
    return (f"{k} in flight, CPU per call: direct {d['cpu_ms_per_call']:.2f} ms; through the gateway "
            f"{g['cpu_ms_per_call']:.2f} ms in the trainer's process (HTTP, JSON, rendering, and the engine's batching "
            f"of staggered arrivals: {g['engine_prefills']} prefills and {g['engine_steps']} decode steps against "
            f"{d['engine_prefills']} and {d['engine_steps']}) and {g['client_cpu_ms_per_call']:.2f} ms in the agents' "
            f"`openai` client. CPU alone sets the p50 ratio at {row['cpu_bound_ratio']['core_each']:.2f}x with a core "
            f"each, {row['cpu_bound_ratio']['one_core']:.2f}x on one core; measured {row['p50_ratio']:.2f}x at load "
            f"{record['load_average_1min']:.1f} on {record['cpus']} cpus.")


def resolved_model(path: str) -> str:
    """The local folder of a ``model.path`` (``tiny`` built, a named model converted, once, as ``fit`` does)."""
    from lightning_agentrl.models.resolve import resolve_model_path
    from lightning_agentrl.settings import load_settings

    return resolve_model_path(load_settings(overrides=[f"--model.path={path}"]))


async def measure(model_path: str, in_flights: list[int], calls: int, tokens: int, window_ms: float, parts: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_agentrl.models import pad_token_id
    from lightning_agentrl.rollout.agent_loop import EpisodeBudget
    from lightning_agentrl.rollout.chat import ChatCodec
    from lightning_agentrl.rollout.engine import SamplingParams, TorchEngine
    from lightning_agentrl.rollout.gateway import Gateway

    path = resolved_model(model_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    codec = ChatCodec(tokenizer)
    engine = TorchEngine(AutoModelForCausalLM.from_pretrained(path), pad_token_id=pad_token_id(tokenizer),
                         max_batch_size=max(in_flights), admission_window_ms=window_ms)
    sampling = SamplingParams(max_new_tokens=tokens, seed=0, stop_token_ids=codec.stop_token_ids)
    budget = EpisodeBudget(max_turns=calls, max_context_tokens=2048)
    gateway, served = Gateway(), []
    gateway.app = _timed(gateway.app, served)
    await gateway.start()
    await _direct(engine, codec, sampling, 2, 1)  # warm both paths
    await _through_gateway(gateway, engine, codec, sampling, budget, 2, 1)
    rows = {}
    for in_flight in in_flights:
        direct, through, client_cpu_s, num_calls = _Tally(), _Tally(), 0.0, in_flight * calls
        served.clear()
        for part in range(parts):  # alternating, so a change in the machine's load falls on both arms alike
            with direct.counting(engine):
                direct.seconds += await _direct(engine, codec, sampling, in_flight, calls // parts, part)
            with through.counting(engine):
                measured = await _through_gateway(gateway, engine, codec, sampling, budget, in_flight, calls // parts, part)
            through.seconds += measured["seconds"]
            client_cpu_s += measured["cpu_s"]
        direct, server = direct.summary(num_calls), _quantiles(served)
        through = {**through.summary(num_calls), "client_cpu_ms_per_call": 1000 * client_cpu_s / num_calls}
        rows[str(in_flight)] = {"direct": direct, "gateway": through, "gateway_server_side": server,
                                "p50_ratio": through["p50_ms"] / direct["p50_ms"],
                                "p99_ratio": through["p99_ms"] / direct["p99_ms"],
                                "server_side_p50_ratio": server["p50_ms"] / direct["p50_ms"],
                                "cpu_bound_ratio": cpu_bound_ratio(direct, through)}
    await gateway.close()
    await engine.close()
    return {"in_flight": rows, "calls_per_episode": calls, "parts": parts, "max_new_tokens": tokens,
            "model": f"{model_path} (torch engine, CPU)", "admission_window_ms": window_ms, "cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0]}  # latency ratios on a busy machine mislead


def main(argv: list[str] | None = None) -> None:
    from lightning_agentrl.settings import TorchEngineSettings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--calls", type=int, default=8, help="calls per episode")
    parser.add_argument("--tokens", type=int, default=16, help="max new tokens per call")
    parser.add_argument("--parts", type=int, default=2,
                        help="each arm's calls in this many parts, the arms alternating (it must divide --calls)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--model-path", default="tiny", help="the model (a model.path: tiny, smollm2-135m-instruct, a folder)")
    parser.add_argument("--admission-window-ms", type=float, default=TorchEngineSettings().admission_window_ms,
                        help="the torch engine's admission window (engine.admission_window_ms; default: its default)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the record (default: {RESULTS.relative_to(REPO)} for tiny, else gateway_<model>.json beside it)")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # the client process
    args = parser.parse_args(argv)
    if args.client:
        print(json.dumps(asyncio.run(_client(json.loads(sys.stdin.read())))))
        return
    if min(args.in_flight) < 1 or args.calls < 1 or args.tokens < 1 or args.parts < 1:
        parser.error("--in-flight, --calls, --tokens and --parts must be >= 1")
    if not (args.admission_window_ms >= 0 and math.isfinite(args.admission_window_ms)):
        parser.error("--admission-window-ms must be a finite number >= 0")
    if args.calls % args.parts:
        parser.error(f"--parts {args.parts} must divide --calls {args.calls}")
    import torch

    torch.set_num_threads(args.threads)
    result = asyncio.run(measure(args.model_path, args.in_flight, args.calls, args.tokens, args.admission_window_ms,
                                 args.parts))
    result["note"] = note(result)
    out = args.out or (RESULTS if args.model_path == "tiny" else RESULTS.with_name(f"gateway_{Path(args.model_path).name}.json"))
    write_record(out, result, config=None, overrides=None, seed=None)
    line = ", ".join(f"{k} in flight: p50 {r['gateway']['p50_ms']:.1f} vs {r['direct']['p50_ms']:.1f} ms "
                     f"({r['p50_ratio']:.2f}x), p99 {r['p99_ratio']:.2f}x, prefills {r['gateway']['engine_prefills']} vs "
                     f"{r['direct']['engine_prefills']}" for k, r in result["in_flight"].items())
    print(f"gateway vs engine directly, {args.model_path}, {line} (load average {result['load_average_1min']:.1f} "
          f"on {result['cpus']} cpus)")


if __name__ == "__main__":
    main()
