"""A scripted coding harness for ``env.agent_in_sandbox`` tests, built-in modules only, run in the task's sandbox
as ``python /tools/sandbox_harness.py SERVICE_PORT`` (the test copies it into the tools folder with ``modes.json``,
task id -> mode, and ``fix/<task id>/``, the task's reference fix).

Every mode first reports what the sandbox lets it see and reach, in its first call to the model (so the report is
in the trained trajectory): its episode's ``/models`` (200), the group's other episode's (403), the sandbox
service's port, an external address, the workspace's files. Then by mode:
``fix`` applies the fix in episode 0 of its group only, then exits 0; ``hang`` starts a process tree (a detached
``sleep 987654``) and sleeps past any timeout; ``fail`` exits 3; ``late`` applies the fix, then exits 1 s before its limit (``AGENT_TIMEOUT_S``, else 10 s).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

BASE, KEY = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
STARTED = time.monotonic()


def status(url: str) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return str(answer.status)
    except urllib.error.HTTPError as err:
        return str(err.code)
    except (urllib.error.URLError, OSError) as err:
        return type(getattr(err, "reason", err)).__name__


def connect(host: str, port: int) -> str:
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "connected"
    except OSError as err:
        return type(err).__name__


def ask(content: str) -> dict:
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": content}], "max_tokens": 8})
    request = urllib.request.Request(f"{BASE}/chat/completions", data=body.encode(), method="POST",
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)


def main() -> int:
    task = json.load(sys.stdin)
    mode = json.load(open("/tools/modes.json"))[task["id"]]
    episode = BASE.rstrip("/").split("/")[-2]  # g3-e0
    other = episode[:-1] + ("1" if episode.endswith("0") else "0")
    report = {
        "own": status(f"{BASE}/models"),
        "other": status(BASE.replace(f"/episodes/{episode}/", f"/episodes/{other}/") + "/models"),
        "service": connect("127.0.0.1", int(sys.argv[1])),
        "external": connect("10.255.255.1", 80),
        "cwd": os.getcwd(),
        "files": sorted(os.listdir(".")),
        "prompt_matches": os.environ["TASK_PROMPT"] == task["prompt"],
    }
    ask("REPORT " + json.dumps(report, sort_keys=True))
    if mode == "fail":
        print("the harness gave up", file=sys.stderr)
        return 3
    if mode == "hang":
        subprocess.Popen(["sleep", "987654"], start_new_session=True)  # detached: must die with the tree anyway
        time.sleep(3600)
    if episode.endswith("e0") or mode == "late":
        shutil.copytree(f"/tools/fix/{task['id']}", ".", dirs_exist_ok=True)
    if mode == "late":  # done 1 s before its limit
        time.sleep(max(float(os.environ.get("AGENT_TIMEOUT_S", 10)) - (time.monotonic() - STARTED) - 1, 0))
    return 0


sys.exit(main())
