"""The run's sandbox service is one object whatever the environment: the node's service where the environment
runs actions in it, else the null object :class:`NoSandbox`, which answers every call and does nothing."""

from __future__ import annotations

import lightning as L

from lightning_agentrl.distributed import NodeSandbox
from lightning_agentrl.sandbox import NoSandbox, make_sandbox
from tests.fitting import REPO, learn_settings


def test_an_environment_without_the_sandbox_service_gets_the_null_object(tmp_path):
    coding = make_sandbox(learn_settings(tmp_path), tmp_path)
    keydoor = make_sandbox(learn_settings(tmp_path, "--env.kind=keydoor", f"--env.tasks={REPO / 'tasks' / 'keydoor' / 'tasks.jsonl'}"),
                           tmp_path)
    assert isinstance(coding, NodeSandbox) and coding.uses_service
    assert isinstance(keydoor, NoSandbox) and not keydoor.uses_service
    assert keydoor.url is None
    assert keydoor.start(local_rank=0, node_rank=0) is None
    assert keydoor.make_client(timeout_s=5, max_retries=0, call_timeout_s=None) is None
    assert keydoor.close() is None
    assert isinstance(keydoor, L.Callback)  # it takes the service's place among the Trainer's callbacks
