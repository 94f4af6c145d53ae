"""What several training processes share: one loss, reduced metrics, one sandbox service per node.

One Lightning rank is one data-parallel trainer with its own rollout service (docs/scaling.md).
Three things cross ranks, and each goes through one function here:

- **The loss's denominators** (:func:`global_sum`): SPEC §2's token and sequence counts are those
  of the whole step, summed over ranks before the backward, and each rank scales its loss by the
  world size because DDP and ZeRO *average* gradients. So R ranks x B/R episodes give the gradient
  of 1 rank x B episodes.
- **Logged metrics** (:func:`reduce_metrics`): sums, means and maxima, each as the metric needs, so
  rank 0 logs the step, not its own share.
- **The sandbox service** (:class:`NodeSandbox`): when settings name none, local rank 0 of every
  node starts the reference server and the node's other ranks use it; the address crosses ranks
  with one ``all_gather_object`` (works with Lightning's launcher, torchrun and SLURM alike).

Every function is a no-op in a single process, so the same code runs a laptop smoke run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_agentrl.sandbox_checks import check_harness_support, check_judge_isolation
from lightning_agentrl.settings import PreflightError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def global_sum(*values: float) -> tuple[float, ...]:
    """The sum over ranks of each value (one all-reduce for all of them); the values themselves
    in a single process. Float64, so token counts stay exact."""
    if not is_distributed():
        return tuple(float(v) for v in values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tuple(tensor.tolist())


def global_max(value: int | float) -> float:
    if not is_distributed():
        return float(value)
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def reduce_metrics(
    metrics: Mapping[str, float],
    *,
    sums: Collection[str] | Callable[[str], bool] = (),
    maxima: Collection[str] = (),
    minima: Collection[str] = (),
) -> dict[str, float]:
    """``metrics`` of this rank -> those of the step: keys in ``sums`` summed, in ``maxima`` maxed,
    in ``minima`` minimized, every other key averaged over ranks (each rank holds the same number of episodes). ``sums`` may
    be a predicate on the key. A key that some rank lacks counts as 0 there. A collective: every
    rank must call it."""
    is_sum = sums if callable(sums) else set(sums).__contains__
    if not is_distributed():
        return dict(metrics)
    # a rank may lack a key another has (e.g. it had nothing to train on): it counts as 0 there
    keys = sorted(set().union(*all_gather(sorted(metrics))))
    values = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64)
    is_extreme = torch.tensor([k in maxima or k in minima for k in keys], dtype=torch.bool)  # bool when empty too
    sign = torch.tensor([-1.0 if k in minima else 1.0 for k in keys], dtype=torch.float64)
    summed = values.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    # min(x) == -max(-x): one MAX all-reduce serves maxima and minima; the other keys are ignored
    largest = torch.where(is_extreme, values * sign, torch.full_like(values, -float("inf")))
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    size = dist.get_world_size()
    out = {}
    for i, key in enumerate(keys):
        if key in maxima or key in minima:
            out[key] = float(largest[i] * sign[i])
        elif is_sum(key):
            out[key] = float(summed[i])
        else:
            out[key] = float(summed[i]) / size
    return out


def gather_to_zero(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0 (None elsewhere); ``[obj]`` in a single process."""
    if not is_distributed():
        return [obj]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _check_local_judge(url: str, token: str, policy: str | None) -> None:
    """The reference server just started here isolates its judges as ``sandbox.judge_isolation`` asks
    (it does only when this process runs as root); ``policy`` None: no check."""
    if policy is None:
        return
    import httpx2

    health = httpx2.get(f"{url}/v1/health", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
    check_judge_isolation(health, policy, where="the reference sandbox server started on this node")


class NodeSandbox(L.Callback):
    """The sandbox service this process's environments talk to.

    With ``url`` set, every rank uses it; with ``urls`` (several servers), every rank uses that fleet
    through a :class:`~sandbox_client.SandboxFleet`. Without either, local rank 0 of each node starts the
    reference server on loopback in :meth:`setup` (after the processes exist, before any episode) and
    stops it in :meth:`teardown`; the node's other ranks learn its address and token from rank 0 of the
    node. :meth:`make_client` is what the rollout service and evaluation call.
    """

    uses_service = True
    """The run's environments talk to a sandbox service (:class:`~lightning_agentrl.sandbox.NoSandbox`: they do not)."""

    def __init__(self, url: str | None, token: str | None, *, timeout_s: float, max_retries: int,
                 log_dir: Path, call_timeout_s: float | None = None, judge_isolation: str | None = "require",
                 tools_dir: Path | None = None, episode_timeout_s: float = 600.0,
                 urls: list[str] | None = None) -> None:
        if url is not None and urls:
            raise ValueError("give url or urls, not both")
        self.url, self.token = url, token
        self.urls = list(urls or [])
        self.tools_dir = tools_dir  # mounted read-only at /tools in the local server's sandboxes
        self.episode_timeout_s = episode_timeout_s  # with tools_dir: the longest command the server must take
        self.judge_isolation = judge_isolation
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.call_timeout_s = call_timeout_s
        self.log_dir = Path(log_dir)
        self._stack = contextlib.ExitStack()

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.url is not None or self.urls:
            return
        self.start(local_rank=trainer.local_rank, node_rank=trainer.node_rank)

    def start(self, *, local_rank: int = 0, node_rank: int = 0) -> None:
        """Start this node's server (local rank 0) and share its address with the node's ranks."""
        mine = None
        if local_rank == 0:
            from sandbox_server.launch import start_local_server

            name = "sandbox_server.log" if node_rank == 0 else f"sandbox_server.node{node_rank}.log"
            try:
                tools = {} if self.tools_dir is None else {  # a harness runs for up to an episode in one command
                    "tools_dir": str(self.tools_dir), "max_timeout_s": max(3600.0, self.episode_timeout_s)}
                server = self._stack.enter_context(start_local_server(log_file=self.log_dir / name, **tools))
            except (OSError, RuntimeError, TimeoutError) as err:  # it never answered its health call
                raise PreflightError(
                    f"sandbox.url: unset, so the reference sandbox server was started on this node, and it did not "
                    f"come up: {type(err).__name__}: {err} (log: {self.log_dir / name})"
                ) from None
            _check_local_judge(server.url, server.token, self.judge_isolation)
            if self.tools_dir is not None:  # env.agent_in_sandbox
                check_harness_support(server.health(), where="the reference sandbox server started on this node",
                                      episode_timeout_s=self.episode_timeout_s)
            mine = (node_rank, server.url, server.token)
        for entry in all_gather(mine):
            if entry is not None and entry[0] == node_rank:
                _, self.url, self.token = entry
        if self.url is None:
            raise RuntimeError(f"no sandbox server was started for node {node_rank}")

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def make_client(self, **options):
        """A client of this node's service with the run's timeouts and retries; ``options`` override them
        (e.g. a health probe: ``timeout_s=5, max_retries=0, call_timeout_s=None``)."""
        from sandbox_client import SandboxClient, SandboxFleet

        options = {"timeout_s": self.timeout_s, "max_retries": self.max_retries,
                   "call_timeout_s": self.call_timeout_s, **options}
        if self.urls:
            return SandboxFleet(self.urls, self.token or "", **options)
        if self.url is None:
            raise RuntimeError("the sandbox service is not started yet (NodeSandbox.setup runs with Trainer.fit)")
        return SandboxClient(self.url, self.token or "", **options)


__all__ = [
    "NodeSandbox",
    "all_gather",
    "gather_to_zero",
    "global_max",
    "global_sum",
    "is_distributed",
    "reduce_metrics",
    "world_size",
]
