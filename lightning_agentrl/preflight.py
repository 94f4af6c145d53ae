"""Start-up checks: every input and service the settings name, in seconds, before any model loads.

Without them a dead sandbox service gives a run that "succeeds" after training on nothing, a bad
``model.path`` ends in a transformers traceback about repo ids, and an unreachable tracking server
costs 200 s of MLflow retries. Each check raises :class:`PreflightError`, a :class:`SettingsError`
whose message names the setting (``env.tasks: no such file or folder: /x``), so the command line prints it
as one ``error:`` line with exit status 2, like every other settings error.

Local checks (no network): the task suite exists and has tasks of the split (and of the held-out
split); ``model.path`` is ``tiny``, a hub id, or a complete model folder: a ``config.json``, a tokenizer and
weights (every shard a sharded index names); a local model's chat template can hold a tool-calling
conversation (``rollout/chat.py``). Network checks,
each with a deadline of :data:`TIMEOUT_S` and no retries: the sandbox service answers its health
call with the token; the MLflow tracking server answers an API call (not only ``/health``); every
``engine.urls`` vLLM server answers (:func:`check_health`, all at once), with its weight-sync
endpoints and a long enough context; a hub id that is not in the local cache exists on the hub.
``validate --offline`` runs the local checks only.

>>> preflight(load_settings("configs/smoke.yaml"))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse

from lightning_agentrl.envs.registry import load_env_tasks
from lightning_agentrl.models.gguf_convert import GGUFError, check_source, is_gguf_source
from lightning_agentrl.rollout.chat import chat_codec, native_tools
from lightning_agentrl.sandbox_checks import (
    check_harness_support,
    check_judge_isolation,
    env_uses_sandbox,
    harness_timeout,
    judge_policy,
)
from lightning_agentrl.settings import (
    PreflightError,
    SandboxSettings,
    Settings,
    SettingsError,
    TrackingSettings,
)

TIMEOUT_S = 5.0
"""Deadline of one start-up health call: a service that does not answer within it counts as down."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def preflight(settings: Settings, *, network: bool = True):
    """Run every start-up check; the first failure raises :class:`PreflightError`. Returns the local model's
    :class:`~lightning_agentrl.rollout.chat.ChatCodec` (None for the tiny model, a hub id or an unconverted GGUF)."""
    check_tasks(settings)
    check_infra_wait(settings)
    check_cache_dir(settings.model.cache_dir)
    check_model_path(settings.model.path, network=network, safetensors=settings.engine.traits.reads_safetensors,
                     cache_dir=settings.model.cache_dir)
    codec = check_chat_template(settings)
    if settings.env.sub_agent is not None:
        check_sub_agent_path(settings.env.sub_agent.model_path, network=network, cache_dir=settings.model.cache_dir)
    if not network:
        return codec
    if env_uses_sandbox(settings):  # only the environments that run actions there need the service
        check_sandbox(settings.sandbox, judge_policy(settings), harness=harness_timeout(settings))
    check_tracking(settings.tracking)
    check_inference_servers(settings.engine.fleet_urls, min_model_len=settings.env.max_context_tokens + 1)
    if settings.model.lora and settings.engine.fleet_urls:
        check_lora_servers(settings)
    return codec


# -- local -----------------------------------------------------------------------------------------
def check_infra_wait(settings: Settings) -> None:
    """``rollout.on_infra_failure: wait`` waits for the sandbox service's health call to answer; an
    environment that uses no sandbox service has nothing to wait for."""
    if settings.rollout.on_infra_failure == "wait" and not env_uses_sandbox(settings):
        raise PreflightError(
            f"rollout.on_infra_failure: 'wait' polls the sandbox service's health, and env.kind "
            f"{settings.env.kind!r} uses no sandbox service (Environment.uses_sandbox is False); use 'stop'"
        )


def check_tasks(settings: Settings) -> None:
    """The tasks exist, load (by ``env.kind``'s loader), and hold tasks of ``env.split`` (and of ``eval.split``
    when evaluating)."""
    root = Path(settings.env.tasks)
    if not root.exists():
        raise PreflightError(f"env.tasks: no such file or folder: {root}")
    splits = [("env.split", settings.env.split)]
    if settings.eval.every_n_steps is not None:
        splits.append(("eval.split", settings.eval.split))
    for setting, split in splits:
        try:
            tasks = load_env_tasks(settings, split)
        except (OSError, ValueError) as err:
            raise PreflightError(f"env.tasks: {err}") from None
        if not tasks:
            raise PreflightError(f"{setting}: no {split} tasks in {root}")
        _check_scoring_fits(settings, tasks)


def _check_scoring_fits(settings: Settings, tasks) -> None:
    """A harness in the sandbox gets the episode's time less its task's scoring time: some must be left."""
    if not settings.env.agent_in_sandbox:
        return
    longest = max(tasks, key=lambda task: task.scoring_timeout_s)
    if longest.scoring_timeout_s >= settings.env.episode_timeout_s:
        raise PreflightError(f"env.episode_timeout_s: {settings.env.episode_timeout_s:g} s leaves the harness no time: "
                             f"task {longest.id!r} keeps {longest.scoring_timeout_s:g} s (its scoring_timeout_s) "
                             "of each episode for its scoring")


def check_cache_dir(cache_dir: str | Path) -> None:
    """``model.cache_dir`` is a folder, or can be made one: its nearest existing parent is a writable folder (an
    existing cache may be read-only: a converted model is only read from it)."""
    folder = Path(cache_dir).expanduser()
    if folder.is_dir():
        return
    if folder.exists():
        raise PreflightError(f"model.cache_dir: {cache_dir} is a file, not a folder")
    parent = next(p for p in folder.absolute().parents if p.exists())
    if not parent.is_dir():
        raise PreflightError(f"model.cache_dir: {cache_dir} cannot be created: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PreflightError(f"model.cache_dir: {cache_dir} cannot be created: {parent} is not writable")


def check_model_path(path: str, *, network: bool = True, safetensors: bool = False,
                     cache_dir: str | Path = ".cache/lightning_agentrl") -> None:
    """``tiny`` (built from its config by ``models/tiny.py``), a named model or a GGUF file (``models/gguf_convert.py``:
    its header is read), a complete model folder (:func:`model_folder_problem`), or a hub id (in the local cache, or
    on a reachable hub). ``safetensors``: the weights must be safetensors (the vLLM engine reads their headers)."""
    if path == "tiny":
        return
    if _is_gguf_source(path):
        gguf_model_folder(path, cache_dir)  # reads the file's header unless it is converted already
        return
    folder = Path(path).expanduser()
    if folder.exists():
        if not folder.is_dir():
            raise PreflightError(f"model.path: {path} is a file; expected a model folder (config.json and weights)")
        problem = model_folder_problem(folder, safetensors=safetensors)
        if problem is not None:
            raise PreflightError(f"model.path: {path} {problem}")
        return
    if _looks_like_a_path(path):
        raise PreflightError(f"model.path: no such folder: {path}")
    if not _HUB_ID.fullmatch(path) or ".." in path:
        raise PreflightError(f"model.path: {path!r} is neither a local folder nor a hub id like 'org/name'")
    if _in_hub_cache(path) or not network:
        return
    _check_on_hub(path)


def _is_gguf_source(path: str) -> bool:
    try:
        return is_gguf_source(path)
    except GGUFError as err:
        raise PreflightError(f"model.path: {err}") from None


def gguf_model_folder(path: str, cache_dir: str | Path) -> Path | None:
    """A GGUF ``model.path``'s converted folder if it has one yet; None otherwise, or for another kind of path.
    A GGUF file that cannot be converted raises :class:`PreflightError`."""
    if not _is_gguf_source(path):
        return None
    try:
        return check_source(path, cache_dir)
    except GGUFError as err:
        raise PreflightError(f"model.path: {err}") from None


def check_sub_agent_path(path: str, *, network: bool = True, cache_dir: str | Path = ".cache/lightning_agentrl") -> None:
    """``env.sub_agent.model_path``: what :func:`check_model_path` accepts, the error naming this setting."""
    try:
        check_model_path(path, network=network, cache_dir=cache_dir)
    except PreflightError as err:
        raise PreflightError("env.sub_agent.model_path" + str(err).removeprefix("model.path")) from None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def model_folder_problem(folder: Path, *, safetensors: bool = False) -> str | None:
    """What keeps ``AutoModelForCausalLM`` and ``AutoTokenizer`` from loading ``folder`` (``"has no ..."``), or None:
    a ``config.json``, one of the tokenizer files, and weights: ``*.safetensors`` or ``pytorch_model*.bin``, or a
    sharded index whose every shard is present."""
    if not (folder / "config.json").is_file():
        return "has no config.json; is it a Hugging Face model folder?"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        return f"has a config.json that is not JSON ({type(err).__name__}: {err})"
    if not isinstance(config, dict) or "model_type" not in config:
        return "has a config.json without a model_type; is it a Hugging Face model folder?"
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return f"has no tokenizer ({', '.join(_TOKENIZER_FILES)}); save one beside the weights (tokenizer.save_pretrained)"
    for index in _WEIGHT_INDEXES:
        if (folder / index).is_file():
            try:
                shards = set(json.loads((folder / index).read_text())["weight_map"].values())
            except (ValueError, KeyError, AttributeError) as err:
                return f"has an unreadable {index} ({type(err).__name__}: {err})"
            missing = sorted(shard for shard in shards if not (folder / shard).is_file())
            if missing:
                return f"lacks {len(missing)} of the {len(shards)} weight shards {index} names: {', '.join(missing[:3])}"
    weights = [*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")]
    if not weights:
        return "has no weights (*.safetensors, pytorch_model*.bin or a sharded index); is the download complete?"
    if safetensors and not any(w.suffix == ".safetensors" for w in weights):
        return "has .bin weights only; engine.kind=vllm needs safetensors (save_pretrained writes them)"
    return None


def check_chat_template(settings: Settings):
    """A local model's chat template can hold the episode's conversation (observation role, end of
    turn, tools as ``env.tool_format`` asks); a hub model's is checked once loaded, still before training.
    Returns the codec, or None where there is no local tokenizer yet."""
    folder = gguf_model_folder(settings.model.path, settings.model.cache_dir) or Path(settings.model.path).expanduser()
    if settings.model.path == "tiny" or not (folder / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # transformers raises OSError, ValueError, ... for a folder it cannot read
        raise PreflightError(f"model.path: the tokenizer in {folder} does not load: {type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}") from None
    try:
        return chat_codec(settings, tokenizer)
    except SettingsError as err:
        raise PreflightError(str(err)) from None


CALL_FORMAT_MARKS = ("{tools}", "<tool_call>", '"name"', "[TOOL_CALLS]")
"""What in a custom ``env.system_prompt`` tells the model how to call its tools (the tool list, or a call format)."""


def describe_model(settings: Settings, codec) -> tuple[list[str], list[str]]:
    """What ``validate`` says about the model: lines (the observation role chosen, the end-of-turn token, how
    the tools reach the model) and warnings (a custom system prompt that tells the model no call format)."""
    if codec is None:
        when = "when the run builds it" if settings.model.path == "tiny" else "when the model is loaded or converted"
        lines = [f"chat template of {settings.model.path}: checked {when}"]
        in_text = settings.env.tool_format != "template"  # the template may render tools=; not known yet
    else:
        in_text = not native_tools(settings, codec)
        tools = ("text: the system prompt's {tools} (env.tool_format=" + settings.env.tool_format + ")" if in_text
                 else "template: the chat template's own tools= rendering")
        end = codec.tokenizer.decode([codec.end_of_turn_id])
        lines = [f"observation role: {codec.observation_role}"
                 f"{'' if settings.env.observation_role else ' (the first the template renders)'}",
                 f"end of turn: {end!r} (id {codec.end_of_turn_id}); generation also stops on "
                 f"{[codec.tokenizer.decode([i]) for i in codec.stop_token_ids]}",
                 f"tools: {tools}"]
    prompt = settings.env.system_prompt
    warnings_ = []
    if prompt is not None and in_text and not any(mark in prompt for mark in CALL_FORMAT_MARKS):
        warnings_.append("env.system_prompt has neither {tools} nor a call format (<tool_call>{\"name\": ..., "
                         "\"arguments\": {...}}</tool_call>): the model is not told how to call its tools")
    return lines, warnings_


def _looks_like_a_path(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or "\\" in path or path.count("/") > 1 or path.endswith("/")


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _check_on_hub(repo_id: str) -> None:
    import httpx2

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise PreflightError(f"model.path: {repo_id} is not a local folder nor in the hub cache, and HF_HUB_OFFLINE is set")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    token = os.environ.get("HF_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{endpoint}/{repo_id}/resolve/main/config.json"
    try:
        response = httpx2.head(url, headers=headers, timeout=TIMEOUT_S, follow_redirects=True)
    except httpx2.HTTPError as err:
        raise PreflightError(
            f"model.path: {repo_id} is not a local folder nor in the hub cache, and the hub ({endpoint}) "
            f"is unreachable: {type(err).__name__}: {err}"
        ) from None
    if response.status_code in (401, 403, 404):
        raise PreflightError(
            f"model.path: the hub ({endpoint}) has no model {repo_id} (HTTP {response.status_code}; "
            f"a gated or private model needs HF_TOKEN)"
        )


# -- network ---------------------------------------------------------------------------------------
def check_sandbox(sandbox: SandboxSettings, judge: str | None, timeout_s: float = TIMEOUT_S,
                  harness: float | None = None) -> None:
    """Each of ``sandbox.url`` / ``sandbox.urls`` answers ``GET /v1/health`` with ``sandbox.token``, speaks this
    client's protocol version, isolates its judges as ``judge`` (:func:`judge_policy`) asks and, with ``harness``
    (``env.agent_in_sandbox``: its ``env.episode_timeout_s``), can run one (no address: the local server, started
    and checked later by ``NodeSandbox``). Every server is asked at once; with several, one error names each
    that fails."""
    addresses = sandbox.addresses
    if not addresses:
        return
    setting = "sandbox.url" if sandbox.url is not None else "sandbox.urls"
    if not sandbox.token_value:
        raise PreflightError(f"sandbox.token: {setting} is set but no token is (the service needs its bearer token; "
                             "a run folder never records it, so --resume last takes it again from --sandbox.token "
                             "or AGENTRL_SANDBOX__TOKEN)")
    answers = asyncio.run(_health_of_each(addresses, sandbox.token_value, timeout_s))
    failures: list[PreflightError] = []
    for url, answer in zip(addresses, answers, strict=True):
        try:
            _check_one_sandbox(url, answer, judge, setting, timeout_s, harness)
        except PreflightError as err:
            failures.append(err)
    if len(addresses) == 1 and failures:
        raise failures[0]
    if failures:
        raise PreflightError(f"sandbox.urls: {len(failures)} of {len(addresses)} sandbox servers failed the start-up "
                             "checks: " + " | ".join(str(err) for err in failures))


async def _health_of_each(urls: list[str], token: str, timeout_s: float) -> list[dict | BaseException]:
    from sandbox_client import SandboxClient

    async def health(url: str) -> dict:
        async with SandboxClient(url, token, timeout_s=timeout_s, max_retries=0) as client:
            return await client.health()

    return list(await asyncio.gather(*(health(url) for url in urls), return_exceptions=True))


def _check_one_sandbox(url: str, answer: dict | BaseException, judge: str | None, setting: str,
                       timeout_s: float, harness: float | None = None) -> None:
    from sandbox_client import SandboxAuthError
    from sandbox_client.client import PROTOCOL_VERSION

    if isinstance(answer, SandboxAuthError):
        raise PreflightError(f"sandbox.token: the sandbox service at {url} refused it: {answer}")
    if isinstance(answer, BaseException):  # unreachable, 5xx, not a URL: all mean "no service here"
        raise PreflightError(f"{setting}: the sandbox service at {url} does not answer its health call within "
                             f"{timeout_s:g} s: {type(answer).__name__}: {answer}")
    if not isinstance(answer, dict) or answer.get("status") != "ok":
        raise PreflightError(f"{setting}: the sandbox service at {url} is not healthy: {answer!r}")
    if answer.get("protocol", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise PreflightError(f"{setting}: the sandbox service at {url} speaks protocol {answer['protocol']!r}; "
                             f"this client speaks {PROTOCOL_VERSION!r}")
    check_judge_isolation(answer, judge, where=f"the sandbox service at {url}")
    if harness is not None:
        check_harness_support(answer, where=f"{setting}: the sandbox service at {url}", episode_timeout_s=harness)


def check_tracking(tracking: TrackingSettings, timeout_s: float = TIMEOUT_S) -> None:
    """An ``http(s)`` ``tracking.uri`` answers a real MLflow API call (search experiments, one result) within
    ``timeout_s``: a server that answers ``/health`` and hangs on the API would otherwise block the run's
    first MLflow call for minutes. A ``sqlite:///`` one lies in an existing folder. Other schemes are left
    to MLflow. Credentials come from MLflow's own variables (``MLFLOW_TRACKING_TOKEN``, or
    ``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD``)."""
    if not tracking.enabled or tracking.uri is None:
        return
    import httpx2

    uri = tracking.uri
    scheme = urlparse(uri).scheme
    if scheme == "sqlite":
        folder = Path(uri.removeprefix("sqlite:///")).parent
        if uri.startswith("sqlite:///") and not folder.is_dir():
            raise PreflightError(f"tracking.uri: the folder of the sqlite store does not exist: {folder}")
        return
    if scheme not in ("http", "https"):
        return
    call = "GET /api/2.0/mlflow/experiments/search"
    insecure = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("1", "true")
    try:
        response = httpx2.get(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search", params={"max_results": 1},
                             headers=_mlflow_auth(), timeout=timeout_s, verify=not insecure)
    except httpx2.TimeoutException as err:
        raise PreflightError(
            f"tracking.uri: the MLflow server at {uri} does not answer {call} within {timeout_s:g} s "
            f"({type(err).__name__}); is it overloaded or hung? Unset tracking.uri to record the run in "
            f"<run.dir>/mlflow.db"
        ) from None
    except httpx2.HTTPError as err:
        raise PreflightError(
            f"tracking.uri: the MLflow server at {uri} is unreachable ({type(err).__name__}: {err}); start it, "
            f"or unset tracking.uri to record the run in <run.dir>/mlflow.db"
        ) from None
    if response.status_code in (401, 403):
        raise PreflightError(
            f"tracking.uri: {uri} refused {call} (HTTP {response.status_code}); set MLFLOW_TRACKING_TOKEN, or "
            f"MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
        )
    if response.status_code != 200 or not _is_json_object(response):
        raise PreflightError(
            f"tracking.uri: {uri} answered HTTP {response.status_code} to {call}: {response.text[:200]!r}; "
            f"is it an MLflow tracking server?"
        )


def _mlflow_auth() -> dict[str, str]:
    import base64

    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    return {}


def _is_json_object(response) -> bool:
    try:
        return isinstance(response.json(), dict)
    except ValueError:
        return False


def check_health(setting: str, urls: Sequence[str], *, path: str = "/health", timeout_s: float = TIMEOUT_S,
                 headers: Mapping[str, str] | None = None) -> None:
    """Every server of ``urls`` answers ``GET <url><path>`` with a 2xx within ``timeout_s`` (all at once, so a
    fleet costs one deadline); else one :class:`PreflightError` naming ``setting`` and every server that
    did not, e.g. ``engine.server_urls: 2 of 8 servers do not answer GET /health within 5 s: ...``."""
    import httpx2

    async def probe(client: httpx2.AsyncClient, url: str) -> str | None:
        try:
            response = await client.get(f"{url.rstrip('/')}{path}")
        except httpx2.HTTPError as err:
            return f"{url} ({type(err).__name__}{f': {err}' if str(err) else ''})"
        return None if response.is_success else f"{url} (HTTP {response.status_code})"

    async def probe_all() -> list[str]:
        async with httpx2.AsyncClient(timeout=timeout_s, headers=dict(headers or {})) as client:
            return [p for p in await asyncio.gather(*(probe(client, url) for url in urls)) if p is not None]

    if not urls:
        raise PreflightError(f"{setting}: no server URL given")
    failed = asyncio.run(probe_all())
    if failed:
        raise PreflightError(f"{setting}: {len(failed)} of {len(urls)} servers do not answer GET {path} within "
                             f"{timeout_s:g} s: {'; '.join(failed)}")


def check_inference_servers(urls: list[str], *, min_model_len: int, timeout_s: float = TIMEOUT_S) -> None:
    """Every ``engine.urls`` server answers ``/health``, has vLLM's development endpoints on (the weight
    sync needs them) and serves prompts as long as ``env.max_context_tokens`` + 1."""
    import httpx2

    if not urls:
        return
    check_health("engine.urls", urls, timeout_s=timeout_s)  # every server at once: a dead fleet costs one deadline
    for url in urls:
        base = url.rstrip("/")
        try:
            health = httpx2.get(f"{base}/health", timeout=timeout_s)
            weight_info = httpx2.get(f"{base}/weight_info", timeout=timeout_s)
            models = httpx2.get(f"{base}/v1/models", timeout=timeout_s).json()["data"]
        except (httpx2.HTTPError, ValueError, KeyError) as err:
            raise PreflightError(f"engine.urls: the vLLM server at {url} does not answer within {timeout_s:g} s "
                                 f"({type(err).__name__}: {err})") from None
        if health.status_code != 200:
            raise PreflightError(f"engine.urls: the vLLM server at {url} is not healthy (HTTP {health.status_code})")
        if weight_info.status_code == 404:
            raise PreflightError(f"engine.urls: {url} has no weight-sync endpoints; start it with "
                                 "VLLM_SERVER_DEV_MODE=1 (docs/inference_fleet.md)")
        served = max((model.get("max_model_len") or 0 for model in models), default=0)
        if served < min_model_len:
            raise PreflightError(f"engine.urls: {url} serves prompts of up to {served} tokens; env.max_context_tokens "
                                 f"needs --max-model-len {min_model_len}")


def check_lora_servers(settings: Settings, timeout_s: float = 120.0) -> None:
    """With ``model.lora_rank`` every ``engine.urls`` server takes this run's adapters: a zero adapter of the
    run's rank and targets, written where the syncs write theirs (``run.dir/engine_weights``, which the servers
    must see), is loaded on each server under a name of its own, then unloaded. A server started without
    ``--enable-lora``, or with a ``--max-lora-rank`` below ``model.lora_rank``, is one error naming the setting."""
    import secrets
    import shutil

    import httpx2

    from lightning_agentrl.lora import VLLMAdapters, check_lora, vllm_lora_args, zero_adapters
    from lightning_agentrl.models.resolve import resolve_model_path
    from lightning_agentrl.run_layout import RunLayout

    model_path = resolve_model_path(settings)
    check_lora(settings.model, model_path)  # the targets and rank fit the model before an adapter is made
    adapters = VLLMAdapters(settings.model, RunLayout(settings.run.dir).engine_weights / f"probe-{secrets.token_hex(4)}",
                            model_path)
    folder, name = adapters.write(zero_adapters(settings.model, model_path), 0), f"probe-{adapters.nonce}"
    needs = f"start them with {' '.join(vllm_lora_args(settings.model.lora_rank))} and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
    try:
        for url in settings.engine.fleet_urls:
            base = url.rstrip("/")
            try:
                response = httpx2.post(f"{base}/v1/load_lora_adapter", timeout=timeout_s,
                                       json={"lora_name": name, "lora_path": str(folder.resolve())})
            except httpx2.HTTPError as err:
                raise PreflightError(f"engine.urls: {url} did not answer a LoRA adapter load ({type(err).__name__})") from None
            if response.status_code == 404:
                raise PreflightError(f"engine.urls: {url} takes no LoRA adapters (no /v1/load_lora_adapter), which "
                                     f"model.lora_rank={settings.model.lora_rank} needs; {needs}")
            if not response.is_success:
                raise PreflightError(_lora_refusal(url, response, settings.model.lora_rank, needs))
            httpx2.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=timeout_s)
    finally:
        shutil.rmtree(adapters.folder, ignore_errors=True)


def _lora_refusal(url: str, response, rank: int, needs: str) -> str:
    """One line for a server's refusal of the start-up adapter, its reason as the server gave it."""
    try:
        reason = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        reason = response.text
    reason = " ".join(str(reason).split())[:300]
    setting = "model.lora_rank" if "max_lora_rank" in reason else "engine.urls"
    return (f"{setting}: {url} refused a LoRA adapter of rank {rank} (HTTP {response.status_code}: {reason}); "
            f"{needs}")


__all__ = [
    "PreflightError", "check_health", "check_inference_servers", "check_judge_isolation", "check_model_path",
    "check_lora_servers", "check_sandbox", "check_tasks", "judge_policy", "check_tracking", "model_folder_problem", "preflight",
]
