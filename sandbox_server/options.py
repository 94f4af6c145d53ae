"""Server options: one pydantic model, one docstring per field.

The same text is the field's documentation here, its ``--flag-name`` help in
``python -m sandbox_server --help`` and the description of its ``SANDBOX_SERVER_<NAME>`` variable
(``__main__`` reads both with pydantic-settings). From Python, pass the fields as keywords
(``ServerOptions(token=..., max_sandboxes=16)``, ``start_local_server(max_sandboxes=16)``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

UID_MAX = 2**31 - 1
"""The highest uid a sandbox or judge may get: setpriv and setresuid read 2**32 - 1 as "unchanged"
(the command would stay root), and some tools take uids as signed 32-bit numbers."""


class ServerOptions(BaseModel):
    """Limits and behaviour of the sandbox service. Every field is a ``--flag-name`` on the CLI."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    token: str = Field(default="", repr=False)
    """Bearer token every request must carry. Never logged; prefer the SANDBOX_SERVER_TOKEN variable
    over ``--token`` because command lines are visible to other users of the host (``ps``)."""

    root_dir: str = ""
    """Directory holding the sandbox workspaces; empty: a stable folder per uid under $TMPDIR
    (``lightning-agentrl-sandboxes-UID``, then ``-1``, ``-2``... while other live servers hold it).
    The server locks it and, at start, removes the sandboxes a killed server left there."""

    isolation: Literal["auto", "bwrap", "process"] = "auto"
    """``bwrap``: bubblewrap namespaces (fails at start if unusable); ``process``: plain subprocess +
    rlimits; ``auto``: bwrap when the host allows it, else process (reported on /v1/health)."""

    sandbox_uid: int = Field(100000, ge=-1)
    """When the server runs as root, sandbox slot i runs its commands as uid ``sandbox_uid + i``
    (one uid per live sandbox: per-uid limits and file permissions then separate sandboxes) and its
    judge as uid ``sandbox_uid + max_sandboxes + i``; -1 keeps the server's uid (refused as root
    without ``allow_root_commands``). The ``2 x max_sandboxes`` uids (at most 2**31 - 1) are locked
    while the server lives: a second server on the host (same mount namespace) whose range would
    overlap takes the next free range (logged; the ranges are on /v1/health)."""

    allow_root_commands: bool = False
    """Let commands run as root when no unprivileged uid works (no bwrap and the interpreter is
    unreachable for other uids, or ``sandbox_uid=-1``). Off: the server refuses to start instead."""

    max_sandboxes: PositiveInt = 256
    """Live sandboxes allowed at once; create and fork answer 429 + Retry-After beyond it."""

    default_ttl_s: PositiveFloat = 1800.0
    """Idle time after which a sandbox is reaped (every call on a sandbox renews it)."""

    max_ttl_s: PositiveFloat = 86400.0
    """Largest ttl_s a client may ask for."""

    reap_interval_s: PositiveFloat = 5.0
    """How often the reaper looks for expired sandboxes."""

    tools_dir: str = ""
    """A host folder mounted read-only at ``/tools`` in every sandbox (bwrap isolation): programs the operator
    installed, e.g. a coding harness in a virtual environment (``make install`` fills ``.tools``); never from
    a task. Empty: none."""

    max_timeout_s: PositiveFloat = 3600.0
    """Largest exec timeout a client may ask for."""

    output_limit_bytes: PositiveInt = 1 << 20
    """Stdout and stderr are each cut at this many bytes; the result is then flagged ``truncated``."""

    max_request_bytes: PositiveInt = 32 << 20
    """Largest request body; bigger requests get 413."""

    max_file_bytes: PositiveInt = 16 << 20
    """Largest file that read_file returns or write_file accepts (413 beyond)."""

    max_files: PositiveInt = 20000
    """Most files a snapshot may hold or list_files returns."""

    fork_timeout_s: PositiveFloat = 25.0
    """Longest a fork may take (a client may ask for less with the request's ``timeout_s``): past it the
    copy is discarded and answered 422 ``snapshot_too_slow``, so no fork is made after its client gave
    up. Below the trainer client's 30 s per attempt."""

    cpu_time_s: PositiveInt = 600
    """RLIMIT_CPU per process (seconds of CPU time)."""

    address_space_bytes: PositiveInt = 4 << 30
    """RLIMIT_AS per process (virtual memory)."""

    max_processes: PositiveInt = 512
    """Processes per sandbox: cgroup ``pids.max`` where cgroups are writable, and RLIMIT_NPROC of the
    sandbox's own uid (server as root)."""

    total_processes: int = Field(default=0, ge=0)
    """Processes of all sandboxes together (``pids.max`` of the parent cgroup of every sandbox's group),
    so the sandboxes cannot take every pid of the host. 0: the smaller of ``max_sandboxes x
    max_processes`` and half of ``kernel.pid_max``. Must be below ``kernel.pid_max`` and at least
    ``max_processes`` (checked at start)."""

    memory_bytes: PositiveInt = 2 << 30
    """Memory per sandbox (cgroup ``memory.limit_in_bytes`` / ``memory.max``, swap included), over all
    of its processes and the tmpfs pages they write."""

    total_memory_bytes: int = Field(default=0, ge=0)
    """Memory of all sandboxes together: a limit on the parent cgroup of every sandbox's group, so N
    sandboxes each under ``memory_bytes`` cannot together starve the host (the kernel reclaims, then
    OOM-kills inside the sandboxes, never the server). 0: three quarters of the host's RAM."""

    disk_bytes: PositiveInt = 512 << 20
    """Disk per sandbox: its folder (workspace and home) is a tmpfs of this size when the server is
    root (RAM-backed: size max_sandboxes x disk_bytes to the host); writes past it fail with ENOSPC."""

    tmp_bytes: PositiveInt = 256 << 20
    """Size of each command's private /tmp (bwrap backend)."""

    file_size_bytes: PositiveInt = 256 << 20
    """RLIMIT_FSIZE: largest file a command can write."""

    open_files: PositiveInt = 1024
    """RLIMIT_NOFILE per process."""

    idempotency_ttl_s: PositiveFloat = 600.0
    """How long results of keyed requests (exec, create, fork) are kept to answer retries."""

    idempotency_max_bytes_per_sandbox: PositiveInt = 32 << 20
    """Bytes of kept answers per sandbox (its oldest go first); at least one exec answer's worst case
    (``12 x output_limit_bytes`` + 4 KiB: two outputs of NULs, 6 bytes each as JSON). A retry whose
    answer was dropped gets 410 ``answer_dropped`` and does not run again."""

    idempotency_max_bytes: PositiveInt = 256 << 20
    """Bytes of kept answers of all sandboxes together (taken first from the sandbox holding the most);
    at least ``idempotency_max_bytes_per_sandbox``."""

    header_timeout_s: PositiveFloat = 10.0
    """A connection whose request headers are not complete this long after it opened (or after its
    last answer) is closed: half-sent requests, which cannot be authenticated yet, do not pile up."""

    body_timeout_s: PositiveFloat = 60.0
    """Longest a request's body may take to arrive once its headers did; past it: 408
    ``request_timeout`` and the connection is closed."""

    max_connections_per_client: PositiveInt = 1024
    """Open connections one client address may hold; more are closed at once (a sandbox with
    ``network: true`` shares the host's loopback address with the trainer: keep it well above the
    trainer's own connections)."""

    capacity_retry_after_s: int = 2
    """Retry-After (seconds) sent with 429 when the server is full."""

    @model_validator(mode="after")
    def _uids_within_bounds(self) -> ServerOptions:
        if self.sandbox_uid >= 0 and self.sandbox_uid + 2 * self.max_sandboxes - 1 > UID_MAX:
            raise ValueError(f"sandbox_uid + 2 x max_sandboxes - 1 ({self.sandbox_uid + 2 * self.max_sandboxes - 1}) "
                             f"exceeds the highest sandbox uid, {UID_MAX}")
        return self

    @model_validator(mode="after")
    def _tools_dir_exists(self) -> ServerOptions:
        if self.tools_dir:
            import os

            if not os.path.isdir(self.tools_dir):
                raise ValueError(f"tools_dir: {self.tools_dir!r} is not a folder")
            self.tools_dir = os.path.realpath(self.tools_dir)
        return self

    @model_validator(mode="after")
    def _ttl_within_bounds(self) -> ServerOptions:
        if self.default_ttl_s > self.max_ttl_s:
            raise ValueError(f"default_ttl_s ({self.default_ttl_s}) exceeds max_ttl_s ({self.max_ttl_s})")
        return self

    @model_validator(mode="after")
    def _answer_budget_holds_an_answer(self) -> ServerOptions:
        largest = largest_exec_answer_bytes(self.output_limit_bytes)
        if self.idempotency_max_bytes_per_sandbox < largest:
            raise ValueError(f"idempotency_max_bytes_per_sandbox ({self.idempotency_max_bytes_per_sandbox}) cannot "
                             f"keep one exec answer of output_limit_bytes={self.output_limit_bytes} (up to {largest} "
                             "bytes): raise it or lower output_limit_bytes")
        if self.idempotency_max_bytes < self.idempotency_max_bytes_per_sandbox:
            raise ValueError(f"idempotency_max_bytes ({self.idempotency_max_bytes}) is below "
                             f"idempotency_max_bytes_per_sandbox ({self.idempotency_max_bytes_per_sandbox})")
        return self

    @classmethod
    def field_names(cls) -> list[str]:
        return list(cls.model_fields)


def largest_exec_answer_bytes(output_limit_bytes: int) -> int:
    """The longest exec answer: stdout and stderr of ``output_limit_bytes`` each, every byte a control
    character that JSON writes as a 6-byte escape (``\\u0000``), plus the other fields."""
    return 12 * output_limit_bytes + 4096


def describe(error: ValidationError) -> str:
    """A validation error as ``field: why`` lines, without the input values (they include the token)."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}"
                     for e in error.errors(include_input=False, include_url=False))
