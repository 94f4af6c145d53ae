"""Server options: one dataclass, one docstring per field, turned into CLI flags by ``__main__``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ServerOptions:
    """Limits and behaviour of the sandbox service. Every field is a ``--flag-name`` on the CLI."""

    token: str = field(default="", repr=False)
    """Bearer token every request must carry. Never logged; prefer the SANDBOX_SERVER_TOKEN variable
    over ``--token`` because command lines are visible to other users of the host (``ps``)."""

    root_dir: str = ""
    """Directory holding the sandbox workspaces; empty: a stable folder per uid under $TMPDIR
    (``lightning-agentrl-sandboxes-UID``, then ``-1``, ``-2``... while other live servers hold it).
    The server locks it and, at start, removes the sandboxes a killed server left there."""

    isolation: Literal["auto", "bwrap", "process"] = "auto"
    """``bwrap``: bubblewrap namespaces (fails at start if unusable); ``process``: plain subprocess +
    rlimits; ``auto``: bwrap when the host allows it, else process (reported on /v1/health)."""

    sandbox_uid: int = 100000
    """When the server runs as root, sandbox slot i runs its commands as uid ``sandbox_uid + i``
    (one uid per live sandbox: per-uid limits and file permissions then separate sandboxes);
    -1 keeps the server's uid (refused as root without ``allow_root_commands``)."""

    allow_root_commands: bool = False
    """Let commands run as root when no unprivileged uid works (no bwrap and the interpreter is
    unreachable for other uids, or ``sandbox_uid=-1``). Off: the server refuses to start instead."""

    max_sandboxes: int = 256
    """Live sandboxes allowed at once; create and fork answer 429 + Retry-After beyond it."""

    default_ttl_s: float = 1800.0
    """Idle time after which a sandbox is reaped (every call on a sandbox renews it)."""

    max_ttl_s: float = 86400.0
    """Largest ttl_s a client may ask for."""

    reap_interval_s: float = 5.0
    """How often the reaper looks for expired sandboxes."""

    max_timeout_s: float = 3600.0
    """Largest exec timeout a client may ask for."""

    output_limit_bytes: int = 1 << 20
    """Stdout and stderr are each cut at this many bytes; the result is then flagged ``truncated``."""

    max_request_bytes: int = 32 << 20
    """Largest request body; bigger requests get 413."""

    max_file_bytes: int = 16 << 20
    """Largest file that read_file returns or write_file accepts (413 beyond)."""

    max_files: int = 20000
    """Most files a snapshot may hold or list_files returns."""

    cpu_time_s: int = 600
    """RLIMIT_CPU per process (seconds of CPU time)."""

    address_space_bytes: int = 4 << 30
    """RLIMIT_AS per process (virtual memory)."""

    max_processes: int = 512
    """Processes per sandbox: cgroup ``pids.max`` where cgroups are writable, and RLIMIT_NPROC of the
    sandbox's own uid (server as root)."""

    memory_bytes: int = 2 << 30
    """Memory per sandbox (cgroup ``memory.limit_in_bytes`` / ``memory.max``, swap included), over all
    of its processes and the tmpfs pages they write."""

    total_memory_bytes: int = 0
    """Memory of all sandboxes together: a limit on the parent cgroup of every sandbox's group, so N
    sandboxes each under ``memory_bytes`` cannot together starve the host (the kernel reclaims, then
    OOM-kills inside the sandboxes, never the server). 0: three quarters of the host's RAM."""

    disk_bytes: int = 512 << 20
    """Disk per sandbox: its folder (workspace and home) is a tmpfs of this size when the server is
    root (RAM-backed: size max_sandboxes x disk_bytes to the host); writes past it fail with ENOSPC."""

    tmp_bytes: int = 256 << 20
    """Size of each command's private /tmp (bwrap backend)."""

    file_size_bytes: int = 256 << 20
    """RLIMIT_FSIZE: largest file a command can write."""

    open_files: int = 1024
    """RLIMIT_NOFILE per process."""

    idempotency_ttl_s: float = 600.0
    """How long results of keyed requests (exec, create, fork) are kept to answer retries."""

    capacity_retry_after_s: int = 2
    """Retry-After (seconds) sent with 429 when the server is full."""

    def __post_init__(self) -> None:
        if self.isolation not in ("auto", "bwrap", "process"):
            raise ValueError(f"isolation must be auto, bwrap or process, got {self.isolation!r}")
        for name in ("max_sandboxes", "output_limit_bytes", "max_request_bytes", "max_file_bytes",
                     "max_files", "cpu_time_s", "address_space_bytes", "max_processes",
                     "file_size_bytes", "open_files", "memory_bytes", "disk_bytes", "tmp_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("default_ttl_s", "max_ttl_s", "reap_interval_s", "max_timeout_s", "idempotency_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.total_memory_bytes < 0:
            raise ValueError(f"total_memory_bytes must be >= 0 (0: 3/4 of the host's RAM), got {self.total_memory_bytes}")
        if self.default_ttl_s > self.max_ttl_s:
            raise ValueError(f"default_ttl_s ({self.default_ttl_s}) exceeds max_ttl_s ({self.max_ttl_s})")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]
