"""deploy/kubernetes/: the manifests are valid Kubernetes objects (the API's own schemas, from the
`kubernetes-validate` package) and agree with the product: the server's flags parse and match the pod's
resources, the training command parses as `fit` settings and names every sandbox pod."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from lightning_agentrl.settings import load_settings
from sandbox_server.__main__ import parse

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "kubernetes"
KUBERNETES = "1.33"  # the API version the schemas are checked against
SERVER_OVERHEAD_BYTES = 1 << 30  # the server itself, beside its sandboxes


def objects(name: str) -> dict[str, dict]:
    """The objects of one manifest file by kind."""
    return {doc["kind"]: doc for doc in yaml.safe_load_all((DEPLOY / name).read_text())}


def quantity(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize("name", ["sandbox.yaml", "training.yaml"])
def test_every_manifest_is_valid_against_the_kubernetes_api_schemas(name):
    docs = list(objects(name).values())
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    typo = copy.deepcopy(docs[-1])
    typo["spec"]["template" if "template" in typo["spec"] else "podSelector"]["metadta"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail: a misspelt field is caught
        kubernetes_validate.validate(typo, KUBERNETES, strict=True)


def test_the_sandbox_pods_match_their_server_flags_and_hold_only_the_privileges_bubblewrap_needs():
    fleet = objects("sandbox.yaml")
    pod = fleet["StatefulSet"]["spec"]["template"]
    server = container(fleet["StatefulSet"])
    listen, options = parse([*server["args"], "--token=x"])
    assert server["command"] == ["python", "-m", "sandbox_server"]
    # the pod's memory holds every sandbox at its limit, and the cgroup total is the pod's, not the node's
    assert options.total_memory_bytes == options.max_sandboxes * options.memory_bytes
    resources = server["resources"]
    assert resources["requests"] == resources["limits"]
    assert quantity(resources["limits"]["memory"]) == options.total_memory_bytes + SERVER_OVERHEAD_BYTES
    # the token comes from a Secret, and every probe asks the health route with it
    (token,) = [env for env in server["env"] if env["name"] == "SANDBOX_SERVER_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "agentrl-sandbox-token", "key": "token"}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        script = server[probe]["exec"]["command"][-1]
        assert f"http://127.0.0.1:{listen.port}/v1/health" in script and 'os.environ["SANDBOX_SERVER_TOKEN"]' in script
    security = server["securityContext"]
    assert security["privileged"] is False and security["capabilities"]["drop"] == ["ALL"]
    assert sorted(security["capabilities"]["add"]) == sorted(
        ["SYS_ADMIN", "SETUID", "SETGID", "CHOWN", "FOWNER", "DAC_OVERRIDE", "KILL", "SYS_CHROOT"])
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["hostUsers"] is False  # root in the pod is an unprivileged uid on the node
    # the headless Service gives each pod its own address (no load balancing in front of the fleet)
    service = fleet["Service"]
    assert service["spec"]["clusterIP"] == "None" and fleet["StatefulSet"]["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == listen.port and listen.host == "0.0.0.0"
    assert service["spec"]["publishNotReadyAddresses"] is True  # the client, not readiness, decides who is live


def test_the_sandbox_pods_disk_holds_every_sandbox_at_its_disk_limit():
    fleet = objects("sandbox.yaml")
    server = container(fleet["StatefulSet"])
    _, options = parse([*server["args"], "--token=x"])
    volumes = {v["name"]: v["emptyDir"] for v in fleet["StatefulSet"]["spec"]["template"]["spec"]["volumes"]}
    (workspaces,) = [m["name"] for m in server["volumeMounts"] if m["mountPath"] == str(options.root_dir)]
    assert quantity(volumes[workspaces]["sizeLimit"]) >= options.max_sandboxes * options.disk_bytes
    on_disk = sum(quantity(v["sizeLimit"]) for v in volumes.values() if v.get("medium") != "Memory")
    assert quantity(server["resources"]["limits"]["ephemeral-storage"]) >= on_disk  # else the pod is evicted first


def test_the_training_job_launches_every_node_and_names_every_sandbox_pod(monkeypatch):
    fleet, training = objects("sandbox.yaml"), objects("training.yaml")
    job, trainer = training["Job"], container(training["Job"])
    script = shlex.split(trainer["args"][0])
    launch = dict(arg.split("=", 1) for arg in script if arg.startswith("--") and "=" in arg)
    fit_args = script[script.index("fit") + 1:]
    env = {entry["name"]: entry for entry in trainer["env"]}
    # one pod per node, torchrun's ranks from the Job's index, node 0 found through the headless Service
    nodes = job["spec"]["completions"]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == nodes
    assert int(launch["--nnodes"]) == nodes and launch["--node_rank"] == "$JOB_COMPLETION_INDEX"
    service = training["Service"]
    assert service["spec"]["clusterIP"] == "None" and job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    assert env["MASTER_ADDR"]["value"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert launch["--master_addr"] == "$MASTER_ADDR"
    assert env["AGENTRL_SANDBOX__TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "agentrl-sandbox-token", "key": "token"}
    # the command is a valid `fit`, and its sandbox.urls are the StatefulSet's pods, each by name
    monkeypatch.setenv("AGENTRL_SANDBOX__URLS", env["AGENTRL_SANDBOX__URLS"]["value"])
    config = fit_args[fit_args.index("--config") + 1]
    settings = load_settings(REPO / config, [arg for arg in fit_args if arg not in ("--config", config)])
    sandboxes = fleet["StatefulSet"]
    name, replicas = sandboxes["metadata"]["name"], sandboxes["spec"]["replicas"]
    port = fleet["Service"]["spec"]["ports"][0]["port"]
    assert settings.sandbox.urls == [f"http://{name}-{i}.{sandboxes['spec']['serviceName']}:{port}" for i in range(replicas)]
    gpus = int(trainer["resources"]["limits"]["nvidia.com/gpu"])
    assert settings.trainer.num_nodes == nodes and settings.trainer.devices == int(launch["--nproc_per_node"]) == gpus
    # room for every process's episodes in flight, each with a scoring copy at its end
    _, options = parse([*container(sandboxes)["args"], "--token=x"])
    assert replicas * options.max_sandboxes >= 2 * nodes * gpus * settings.rollout.max_in_flight
    # the sandbox pods let in the trainer's pods
    allowed = fleet["NetworkPolicy"]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert json.loads(env["AGENTRL_SANDBOX__URLS"]["value"]) == settings.sandbox.urls
