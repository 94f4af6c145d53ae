"""The protocol's result types: the server answers with them (its OpenAPI schema names them) and the
client returns them, so both sides read one definition."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ExecResult(BaseModel):
    """Outcome of one command. ``exit_code`` is negative (-signal) when the process was killed."""

    model_config = ConfigDict(frozen=True)

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
        """The result in a server's answer; a ValueError (pydantic's ValidationError) when it is not one."""
        return cls.model_validate(data)
