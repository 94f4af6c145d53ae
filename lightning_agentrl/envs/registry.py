"""``env.kind``: a shipped environment's name or a user's class by dotted path (``my_pkg.envs:SearchEnv``).

>>> env_class("coding").__name__
'CodingEnv'
>>> env_class("lightning_agentrl.envs.keydoor:KeyDoorEnv").__name__
'KeyDoorEnv'
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_agentrl.envs.base import Environment, EnvTask

if TYPE_CHECKING:
    from lightning_agentrl.settings import EnvSettings, Settings

SHIPPED = {
    "coding": "lightning_agentrl.envs.coding:CodingEnv",
    "keydoor": "lightning_agentrl.envs.keydoor:KeyDoorEnv",
    "gateway": "lightning_agentrl.envs.gateway:GatewayEnv",  # an external agent through the OpenAI-style gateway
}
"""The environments that come with the package, by the name ``env.kind`` takes."""

__all__ = ["SHIPPED", "EnvTask", "env_class", "load_env_tasks", "settings_env_class"]


def env_class(kind: str) -> type[Environment]:
    """The :class:`Environment` subclass ``kind`` names; ``ValueError`` saying what is wrong otherwise."""
    path = SHIPPED.get(kind, kind)
    module_name, sep, class_name = path.partition(":")
    if not sep or not module_name or not class_name or "." in class_name:
        raise ValueError(f"{kind!r} is neither a shipped environment ({', '.join(SHIPPED)}) nor a dotted path "
                         "module.path:ClassName")
    module = _import(kind, module_name)
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"module {module_name!r} has no {class_name!r}")
    _check_class(path, cls)
    return cls


def settings_env_class(env: EnvSettings) -> type[Environment]:
    """The environment class of the ``env`` section: ``env.kind``'s, or with ``env.agent_in_sandbox`` the harness
    run in the task's sandbox (:class:`~lightning_agentrl.envs.sandbox_agent.SandboxAgentEnv`)."""
    if env.kind == "gateway" and env.agent_in_sandbox:
        from lightning_agentrl.envs.sandbox_agent import SandboxAgentEnv

        return SandboxAgentEnv
    return env_class(env.kind)


def _import(kind: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import {module_name!r} (from {kind!r}): {err}") from None
    except Exception as err:  # a SyntaxError, an error raised while the module runs
        raise ValueError(f"cannot import {module_name!r} (from {kind!r}): {type(err).__name__}: {err}") from err


def _check_class(path: str, cls) -> None:
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ValueError(f"{path} is not a subclass of lightning_agentrl.envs.base.Environment")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"{path} does not implement {missing} (abstract in Environment)")
    sync = [name for name in ("reset", "step", "close") if not inspect.iscoroutinefunction(getattr(cls, name))]
    if sync:
        raise ValueError(f"{path}: {', '.join(sync)} must be `async def` (the rollout service awaits them on its "
                         "event loop; run blocking work with `await asyncio.to_thread(...)`)")
    _check_similarity(path, cls.state_similarity)


def _check_similarity(path: str, similar) -> None:
    """``state_similarity``, as GiGPO calls it (on the class, with two state texts): callable with two
    arguments, and where it understands the probe ``("a", "a")`` (a similarity may parse only its own
    states), 1.0 for those equal states."""
    if similar is None:
        return
    try:
        inspect.signature(similar).bind("a", "a")
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: state_similarity must be a function of two state texts, e.g. a @staticmethod "
                         f"(GiGPO calls it on the class): {err}") from None
    try:
        value = similar("a", "a")
    except Exception:  # noqa: BLE001 - it may parse its own state texts only; the range is checked in use
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value != 1.0:
        raise ValueError(f"{path}: state_similarity('a', 'a') returned {value!r}; it must be a similarity in [0, 1], "
                         "1.0 for equal states (not a distance)")


def load_env_tasks(settings: Settings, split: str, *, tasks: str | Path | None = None) -> list[EnvTask]:
    """The tasks of ``split`` ("train", "test" or "all") at ``env.tasks``, read by the environment's loader;
    ``ValueError`` when a task has no ``id`` (a non-empty str) or two share one (results are kept by id)."""
    path = settings.env.tasks if tasks is None else tasks
    cls = settings_env_class(settings.env)
    try:
        loaded = list(cls.load_tasks(path, split=None if split == "all" else split))
    except Exception as err:  # a user's loader failing otherwise: still a problem of env.tasks
        if isinstance(err, OSError | ValueError):
            raise
        raise ValueError(f"{cls.__name__}.load_tasks({str(path)!r}) failed: {type(err).__name__}: {err}") from err
    seen: set[str] = set()
    for index, task in enumerate(loaded):
        task_id = getattr(task, "id", None)
        if not isinstance(task_id, str) or not task_id:
            raise ValueError(f"{cls.__name__}.load_tasks: task {index} ({type(task).__name__}) has no `id` "
                             f"(a non-empty str), got {task_id!r}")
        if task_id in seen:
            raise ValueError(f"{cls.__name__}.load_tasks: two tasks share the id {task_id!r} (ids must be unique)")
        seen.add(task_id)
    return loaded
