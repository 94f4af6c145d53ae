"""``python -m lightning_agentrl export`` refuses what is not a checkpoint with one clear line."""

from __future__ import annotations

import os

import pytest

from lightning_agentrl.__main__ import main
from lightning_agentrl.datamodule import RolloutDataModule


@pytest.mark.parametrize("kind", ["truncated", "empty", "foreign", "fifo", "missing"])
def test_export_refuses_what_is_not_a_checkpoint(tmp_path, capsys, kind):
    path = tmp_path / "last.ckpt"
    if kind == "truncated":
        path.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "foreign":
        path.write_text("SQLite format 3")
    elif kind == "fifo":
        os.mkfifo(path)  # reading it would block forever
    assert main(["export", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(path) in err
    assert not (tmp_path / "out").exists()


def test_export_refuses_an_output_that_is_a_file_and_a_dtype_that_is_not_a_float(tmp_path, capsys):
    out = tmp_path / "afile"
    out.write_text("x")
    assert main(["export", str(tmp_path / "none.ckpt"), str(out)]) == 2
    assert "is not a folder" in capsys.readouterr().err and out.read_text() == "x"
    for dtype in ("int8", "nope"):
        assert main(["export", str(tmp_path / "none.ckpt"), str(tmp_path / "o"), "--dtype", dtype]) == 2
        assert "floating-point" in capsys.readouterr().err


class _Service:
    def __init__(self) -> None:
        self.loaded = None

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def test_a_checkpoint_from_before_several_processes_still_resumes():
    service = _Service()
    RolloutDataModule(service).load_state_dict({"service": {"next_group": 6}})  # the old layout
    assert service.loaded == {"next_group": 6}
    RolloutDataModule(service).load_state_dict({"services": [{"next_group": 8}]})
    assert service.loaded == {"next_group": 8}
    with pytest.raises(ValueError, match="2 training processes, this run has 1"):
        RolloutDataModule(service).load_state_dict({"services": [{}, {}]})
