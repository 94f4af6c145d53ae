"""Result types returned by the client."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command. ``exit_code`` is negative (-signal) when the process was killed."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_json(cls, data: dict) -> ExecResult:
        return cls(exit_code=int(data["exit_code"]), stdout=str(data["stdout"]), stderr=str(data["stderr"]),
                   timed_out=bool(data["timed_out"]), truncated=bool(data["truncated"]),
                   duration_s=float(data["duration_s"]))
