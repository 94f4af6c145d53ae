"""A coding harness run in the task's sandbox (``env.agent_in_sandbox``), through ``fit``: what it reaches, how it is
scored, how it ends. ``tests/sandbox_harness.py`` is a scripted harness; mini-swe-agent is the real one."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.settings import SettingsError, load_settings
from lightning_agentrl.train import resolve_model_path
from lightning_agentrl.trajectory import TerminationReason
from sandbox_server.launch import start_local_server
from tests.fitting import REPO, TINY
from tests.test_gateway import assert_trains_what_was_sampled, gateway_fit

MODES = {"parse_date_day_first": "fix", "leap_year_century": "hang", "chunked_drops_tail": "fail"}
TOOLS = REPO / ".tools"


def sandbox_settings(root: Path, suite: Path, *overrides: str):
    return load_settings(
        REPO / "tests" / "fixtures" / "tiny_bugfix.yaml",
        [f"--run.dir={root / 'run'}", "--env.kind=gateway", "--env.agent_in_sandbox=true", f"--env.tasks={suite}",
         f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}", "--trainer.threads=1",
         "--engine.max_new_tokens=16", "--rollout.group_size=2", "--rollout.max_in_flight=6",
         "--tracking.enabled=false", "--tracking.sample_trajectories=0", *TINY, *overrides],
    )


def scripted_tools(root: Path, modes: dict[str, str] = MODES) -> tuple[Path, Path]:
    """A tools folder with the scripted harness, its modes and the tasks' fixes; a suite of those tasks (each keeping
    6 s of an episode for its scoring)."""
    tools, suite = root / "tools", root / "suite"
    tools.mkdir(parents=True)
    shutil.copy(REPO / "tests" / "sandbox_harness.py", tools / "sandbox_harness.py")
    (tools / "modes.json").write_text(json.dumps(modes))
    for task in modes:
        shutil.copytree(REPO / "tasks" / "bugfix" / task, suite / task)
        spec = json.loads((suite / task / "task.json").read_text())
        (suite / task / "task.json").write_text(json.dumps({**spec, "scoring_timeout_s": 6}))
        shutil.copytree(REPO / "tasks" / "bugfix" / task / "solution", tools / "fix" / task)
    return tools, suite


class ProcessWatch:
    """Whether a process whose command line is ``argv`` ran on this host while watched, and runs still."""

    def __init__(self, argv: list[str]) -> None:
        self.cmdline, self.seen, self._stop = "\0".join(argv) + "\0", False, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def running(self) -> bool:
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and (entry / "cmdline").read_text() == self.cmdline:
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state not in ("Z", "X"):
                        return True
            except OSError:
                continue
        return False

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self.seen = self.seen or self.running()

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def reports(trajectory, codec) -> dict:
    """The report the scripted harness sent in its first call (the trained context holds it)."""
    text = codec.decode(trajectory.segments[0].token_ids)
    return json.loads(text.split("REPORT ", 1)[1].split("}", 1)[0] + "}")


def test_a_harness_in_the_sandbox_reaches_only_its_gateway_and_is_scored_by_the_hidden_tests(tmp_path):
    tools, suite = scripted_tools(tmp_path)
    with start_local_server(tools_dir=str(tools), log_file=tmp_path / "sandbox.log") as service, \
            ProcessWatch(["sleep", "987654"]) as watch:
        port = service.url.rsplit(":", 1)[1]
        settings = sandbox_settings(
            tmp_path, suite, f"--sandbox.url={service.url}", f"--sandbox.token={service.token}",
            f"--env.agent_command=[python, /tools/sandbox_harness.py, '{port}']", "--rollout.groups_per_step=3",
            "--trainer.max_steps=1", "--env.episode_timeout_s=12", "--rollout.max_infra_error_frac=1.0")
        result, log, calls = gateway_fit(settings)
        assert not watch.running()  # the hung harness's detached child died with its tree
    assert watch.seen
    assert result.global_step == 1
    trajectories = log.batches[0].trajectories
    assert_trains_what_was_sampled(trajectories, calls)
    codec = ChatCodec(__import__("transformers").AutoTokenizer.from_pretrained(resolve_model_path(settings)))
    by_task: dict[str, list] = {}
    for t in sorted(trajectories, key=lambda t: t.episode_id[-1]):
        by_task.setdefault(t.task_id, []).append(t)
        report = reports(t, codec)
        workspace = sorted(p.name for p in (suite / t.task_id / "workspace").iterdir())  # no hidden test in it
        assert report == {"own": "200", "other": "403", "service": "ConnectionRefusedError",
                          "external": report["external"], "cwd": "/workspace", "files": workspace,
                          "prompt_matches": True}
        assert report["external"] in ("OSError", "ConnectionRefusedError")
    fixed, unfixed = by_task["parse_date_day_first"]
    assert (fixed.termination, fixed.reward, unfixed.termination, unfixed.reward) == (
        TerminationReason.SUBMITTED, 1.0, TerminationReason.SUBMITTED, 0.0)
    assert fixed.info["hidden_passed"] > 0 and unfixed.info["workspace_unscorable"] is False
    assert all(t.termination is TerminationReason.TIMEOUT for t in by_task["leap_year_century"])
    assert all(t.termination is TerminationReason.AGENT_ERROR and t.info["agent_error"].endswith("the harness gave up")
               for t in by_task["chunked_drops_tail"])
    included = {t.task_id for t, keep in zip(trajectories, log.batches[0].include.tolist(), strict=True) if keep}
    assert "chunked_drops_tail" not in included and "parse_date_day_first" in included
    assert log.metrics[0]["termination/agent_error"] == 2


def test_a_harness_that_fixes_the_bug_just_before_its_limit_is_scored(tmp_path):
    """The scoring's time is kept out of the harness's: one ending 1 s before its limit (``AGENT_TIMEOUT_S``) is
    scored, not cut off as a timeout by the scoring's ~2 s."""
    tools, suite = scripted_tools(tmp_path, {"parse_date_day_first": "late"})
    with start_local_server(tools_dir=str(tools), log_file=tmp_path / "sandbox.log") as service:
        port = service.url.rsplit(":", 1)[1]
        settings = sandbox_settings(
            tmp_path, suite, f"--sandbox.url={service.url}", f"--sandbox.token={service.token}",
            f"--env.agent_command=[python, /tools/sandbox_harness.py, '{port}']", "--trainer.max_steps=1",
            "--env.episode_timeout_s=10")
        _, log, _ = gateway_fit(settings)
    ends = [(t.termination, t.reward) for t in log.batches[0].trajectories]
    assert len(ends) >= 2 and set(ends) == {(TerminationReason.SUBMITTED, 1.0)}, ends


def test_an_episode_too_short_for_the_scoring_is_refused_before_work_starts(tmp_path):
    from lightning_agentrl.preflight import PreflightError, check_tasks

    tools, suite = scripted_tools(tmp_path)
    settings = sandbox_settings(tmp_path, suite, "--env.agent_command=[sh]", "--env.episode_timeout_s=6",
                                f"--sandbox.tools_dir={tools}")
    with pytest.raises(PreflightError, match="env.episode_timeout_s: 6 s leaves the harness no time: task "):
        check_tasks(settings)


@pytest.mark.skipif(not (TOOLS / "bin" / "python").exists(), reason="make install installs mini-swe-agent into .tools")
def test_mini_swe_agent_trains_unchanged_in_the_sandbox(tmp_path):
    """The recipe (configs/mini_swe_agent.yaml): mini-swe-agent from the registry, in the sandbox, two steps."""
    settings = load_settings(REPO / "configs" / "mini_swe_agent.yaml", [
        f"--run.dir={tmp_path / 'run'}", f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}",
        f"--sandbox.tools_dir={TOOLS}", "--rollout.groups_per_step=1", "--engine.max_new_tokens=24",
        "--tracking.enabled=false", "--tracking.sample_trajectories=0", *TINY])
    result, log, calls = gateway_fit(settings)
    assert result.global_step == 2
    trajectories = [t for batch in log.batches for t in batch.trajectories]
    assert len(trajectories) == 4
    assert_trains_what_was_sampled(trajectories, calls)  # masks on exactly the sampled ids
    codec = ChatCodec(__import__("transformers").AutoTokenizer.from_pretrained(resolve_model_path(settings)))
    for t in trajectories:
        assert t.termination is TerminationReason.SUBMITTED, t.info  # mini ended at its step limit, then was scored
        # its step limit (4) or its limit of 3 replies in a row without a tool call ended it
        assert 3 <= t.info["gateway_calls"] == len(t.turns) <= 4 and "hidden_passed" in t.info and t.reward == 0.0
        assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in codec.decode(t.segments[0].token_ids)  # mini's own prompt
    for batch, metrics in zip(log.batches, log.metrics, strict=True):
        assert metrics["gateway/prefix_breaks"] == sum(t.info["prefix_breaks"] for t in batch.trajectories)
        assert metrics["gateway/calls"] == sum(t.info["gateway_calls"] for t in batch.trajectories) >= 6


@pytest.mark.parametrize(("overrides", "message"), [
    (["--env.agent_in_sandbox=true"], "env.agent_in_sandbox runs env.agent_command"),
    (["--env.kind=gateway", "--env.agent=tests.gateway_agents:tool_agent", "--env.agent_in_sandbox=true"],
     "env.agent_in_sandbox runs env.agent_command"),
    (["--env.kind=gateway", "--env.agent_command=[/tools/bin/x]", "--env.agent_in_sandbox=true",
      "--sandbox.tools_dir=/no/such/folder"], "sandbox.tools_dir: '/no/such/folder' is not a folder"),
    (["--env.kind=gateway", "--env.agent_command=[/tools/no-such-harness]", "--env.agent_in_sandbox=true",
      f"--sandbox.tools_dir={REPO / 'tests'}"], "/tools/no-such-harness is not in sandbox.tools_dir"),
    (["--env.kind=gateway", "--env.agent_command=[sh]", "--env.agent_in_sandbox=true",
      "--sandbox.url=http://10.1.2.3:8080"], "needs the sandbox service on this host"),
    (["--env.kind=gateway", "--env.agent_command=[sh, -c, 'cd /tmp && python /tools/no-such.py --x']",
      "--env.agent_in_sandbox=true", f"--sandbox.tools_dir={REPO / 'tests'}"], "/tools/no-such.py is not in sandbox.tools_dir"),
])
def test_sandbox_agent_settings_are_checked_before_work_starts(overrides, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml", overrides)


@pytest.mark.parametrize("where", ["same", "tools_inside_tasks", "tasks_inside_tools"])
def test_validate_refuses_a_tools_folder_that_overlaps_the_tasks(tmp_path, capsys, where):
    """Every sandbox sees ``sandbox.tools_dir`` as /tools: holding the tasks, it would hand a harness their solutions."""
    from lightning_agentrl.__main__ import main

    tools, suite = scripted_tools(tmp_path)
    tools_dir, tasks = {"same": (suite, suite), "tools_inside_tasks": (suite / "parse_date_day_first", suite),
                        "tasks_inside_tools": (tmp_path / "." / "", suite)}[where]
    shutil.copy(tools / "sandbox_harness.py", tools_dir / "sandbox_harness.py")
    code = main(["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", "--env.kind=gateway",
                 "--env.agent_in_sandbox=true", f"--env.tasks={tasks}", f"--sandbox.tools_dir={tools_dir}",
                 "--env.agent_command=[python, /tools/sandbox_harness.py]"])
    err = capsys.readouterr().err
    assert code == 2 and "sandbox.tools_dir:" in err and "overlaps env.tasks" in err, err


def test_a_sandbox_service_without_a_tools_folder_is_refused_before_work_starts(tmp_path):
    from lightning_agentrl.preflight import PreflightError
    from lightning_agentrl.train import fit

    tools, suite = scripted_tools(tmp_path)
    with start_local_server(log_file=tmp_path / "sandbox.log") as service:  # no --tools-dir
        settings = sandbox_settings(tmp_path, suite, f"--sandbox.url={service.url}", f"--sandbox.token={service.token}",
                                    "--env.agent_command=[python, /tools/sandbox_harness.py, '1']")
        with pytest.raises(PreflightError, match="cannot run a harness in its sandboxes: it lacks a tools folder"):
            fit(settings)


def test_a_sandbox_service_that_fails_is_a_sandbox_error_not_the_agents(tmp_path):
    """The service is gone mid-run: the episode ends ``sandbox_error`` (infrastructure), not ``agent_error``."""
    import asyncio

    from lightning_agentrl.envs.sandbox_agent import SandboxAgentEnv
    from lightning_agentrl.rollout.agent_loop import EpisodeBudget
    from lightning_agentrl.rollout.engine import SamplingParams
    from lightning_agentrl.rollout.gateway import Gateway
    from lightning_agentrl.tasks import load_tasks
    from sandbox_client import SandboxClient

    settings = load_settings(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml", [
        "--env.kind=gateway", "--env.agent_in_sandbox=true", "--env.agent_command=[sh]", f"--sandbox.tools_dir={tmp_path}"])
    task = load_tasks(REPO / "tasks" / "bugfix" / "parse_date_day_first", split=None)[0]

    async def play():
        async with SandboxClient("http://127.0.0.1:9", "token", timeout_s=1, max_retries=0) as client:
            gateway = Gateway()
            try:
                return await gateway.play(engine=None, env=SandboxAgentEnv(task, settings.env, client), codec=_NoCodec(),
                                          sampling=SamplingParams(max_new_tokens=4), budget=EpisodeBudget.from_settings(settings.env),
                                          episode_id="g0-e0", task_id=task.id, group_id=0)
            finally:
                await gateway.close()

    trajectory = asyncio.run(play())
    assert trajectory.termination is TerminationReason.SANDBOX_ERROR
    assert "SandboxInfraError" in trajectory.info["sandbox_error"] or "Connect" in trajectory.info["sandbox_error"]


class _NoCodec:
    stop_token_ids = ()


def test_the_harness_reaches_the_gateway_on_its_own_loopback_as_documented():
    import doctest

    from lightning_agentrl.envs import sandbox_agent

    result = doctest.testmod(sandbox_agent, raise_on_error=False, verbose=False)
    assert (result.attempted, result.failed) == (1, 0)


def test_evaluate_shows_a_harness_that_scores_without_calling_the_model(tmp_path, capsys):
    """A harness that solves the task from what it brings, never asking the policy: success 1, called_model_frac 0."""
    from lightning_agentrl.__main__ import main

    tools, suite = scripted_tools(tmp_path, {"parse_date_day_first": "fix"})
    (tools / "copy_fix.py").write_text("import json, shutil, sys\ntask = json.load(sys.stdin)\n"
                                       "shutil.copytree(f\"/tools/fix/{task['id']}\", '.', dirs_exist_ok=True)\n")
    settings = sandbox_settings(tmp_path, suite, "--env.agent_command=[sh]", f"--sandbox.tools_dir={tools}")
    code = main(["evaluate", resolve_model_path(settings), "--config", "tests/fixtures/tiny_bugfix.yaml", "--split",
                 "all", "--samples", "2", "--json", "--env.kind=gateway", "--env.agent_in_sandbox=true",
                 f"--env.tasks={suite}", f"--sandbox.tools_dir={tools}", "--env.agent_command=[python, /tools/copy_fix.py]",
                 f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}", "--trainer.threads=1", *TINY])
    assert code == 0, capsys.readouterr().err
    scores = json.loads(capsys.readouterr().out)
    assert (scores["episodes"], scores["success"], scores["called_model_frac"]) == (2, 1.0, 0.0)
