"""How commands run: bubblewrap namespaces when the host allows it, else plain subprocess + rlimits.

Both backends:
- start the command in a new session (its own process group) so a timeout kills the whole tree;
- give the command, and everything it starts, the rlimits (CPU time, address space, processes,
  file size, open files, no core) and its sandbox's cgroup (processes, memory) before it runs;
- run it as uid ``sandbox_uid + slot`` when the server runs as root (one uid per live sandbox),
  and refuse to start at all when commands could only run as root (``allow_root_commands``);
- give it a minimal environment whose PATH starts with the server's own Python, so
  ``python -m pytest`` resolves to the interpreter (and venv) the server runs on; the request's
  ``env`` is added on top, loader and libc variables refused (``refused_env_name``).

bwrap adds: new mount/pid/ipc/uts (and, unless asked, network) namespaces; only /usr, the Python
prefix (read-only), a private sized /tmp and the workspace (read-write, at /workspace) are visible.
When the command's main process exits, the pid namespace dies and takes background daemons with it.
bwrap (and setpriv, as root) run on the host side as the server's uid before any namespace
exists, so they start with ``HOST_ENV`` only: the request's environment is applied after the uid
drop (``env -i`` after setpriv; ``--setenv`` once bwrap dropped its capabilities). bwrap's
options go in a memfd (``--args FD``), so no host path shows in ``/proc/1/cmdline`` inside.
bwrap is started without a pre-exec hook (vfork) and its sandboxed child gets the rlimits and the
cgroup while it waits on ``--block-fd``.

The process backend has none of that: the command sees the host filesystem with the permissions of
its uid, and shares the host network unless ``unshare --net`` works. Daemons that leave the process
group are found by an environment marker and killed.
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import ctypes
import functools
import json
import marshal
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_server.limits import Cgroups, join_cgroups
from sandbox_server.options import ServerOptions
from sandbox_server.seccomp import build_filter, write_memfd

SANDBOX_WORKDIR = "/workspace"
TOOLS_DIR = "/tools"
"""Where the server's ``tools_dir`` is mounted, read-only, in every bwrap sandbox."""
_MARKER_VAR = "SANDBOX_EXEC_MARKER"
# The only environment the host-side helpers (bwrap, setpriv, unshare) ever see: they may run as
# real root before any namespace exists, so nothing a request carries reaches them.
HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
# Variables the dynamic loader or libc act on (glibc's "unsecure" list): refused in requests, so a
# command never starts with a preloaded library or a foreign locale/iconv path, wherever it starts.
REFUSED_ENV_PREFIXES = ("LD_",)
REFUSED_ENV_NAMES = frozenset({
    "GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE", "NIS_PATH",
    "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR", _MARKER_VAR,
})


def refused_env_name(name: str) -> bool:
    """True for a variable a request may not set (loader and libc configuration)."""
    return name.startswith(REFUSED_ENV_PREFIXES) or name in REFUSED_ENV_NAMES
_DRAIN_GRACE_S = 0.5
# Starting commands gets its own threads: a long file operation (a fork's copy) on the default
# executor must not delay every command start behind it.
_SPAWN_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="sandbox-spawn")
_PAIR_LAUNCH_SOURCE = (Path(__file__).resolve().parent / "pair_launch.py").read_text(encoding="utf-8")
_ARGS_FD_SLOT = "<args-fd>"  # placeholder (compared by identity) for the memfd number
_SECCOMP_FD_SLOT = "<seccomp-fd>"  # the same, in bwrap's options, for the seccomp program's memfd
_PR_SET_PDEATHSIG = 1
try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # not Linux/glibc: no parent-death signal
    _libc = None


@dataclass(frozen=True)
class Limits:
    cpu_time_s: int
    address_space_bytes: int
    max_processes: int
    file_size_bytes: int
    open_files: int

    @classmethod
    def from_options(cls, options: ServerOptions) -> Limits:
        return cls(options.cpu_time_s, options.address_space_bytes, options.max_processes,
                   options.file_size_bytes, options.open_files)


@dataclass
class Launch:
    """A command ready to start: ``argv`` and ``env`` for the host exec; ``bwrap_args``, when set, are
    written NUL-separated to a memfd whose number replaces the ``_ARGS_FD_SLOT`` item of ``argv``."""

    argv: list[str]
    env: dict[str, str]
    bwrap_args: list[str] | None
    seccomp: bytes | None = None  # the filter's program, for ``_args_file`` (bwrap only)

    def host_argv(self, fds: tuple[int, ...]) -> list[str]:
        return [str(fds[0]) if arg is _ARGS_FD_SLOT else arg for arg in self.argv]


@dataclass
class RunResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    duration_s: float


@dataclass
class IsolationReport:
    """What the chosen backend isolates; served verbatim on /v1/health."""

    backend: str
    uid: int
    namespaces: list[str]
    network_isolated_by_default: bool
    process_limit_enforced: bool
    enforced: dict[str, str | None] = field(default_factory=dict)
    """Per-sandbox limit -> how it is enforced, or None when it is not (see docs/sandbox.md)."""
    isolated: list[str] = field(default_factory=list)
    not_isolated: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def pair_spec_arg(spec: dict) -> str:
    """The pair launcher's spec as its one argument: :mod:`marshal` (the launcher's interpreter is this
    one) in base64, which the launcher decodes with built-in modules only (``json`` would cost it a
    third of its start-up). Linux caps one argument at 128 KiB; the server checks this length before
    the exec (``_check_pair_spec_size``)."""
    return binascii.b2a_base64(marshal.dumps(spec), newline=False).decode("ascii")


def _python_dirs() -> list[str]:
    """Directories the interpreter needs (venv prefix, base prefix, the executable's real location)."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  str(Path(os.path.realpath(sys.executable)).parent.parent)}
    dirs = sorted(os.path.realpath(d) for d in candidates if d)
    # Keep only outermost directories, and skip what /usr already covers.
    kept: list[str] = []
    for d in dirs:
        if d == "/usr" or d.startswith("/usr/") or any(d.startswith(k + "/") for k in kept):
            continue
        kept.append(d)
    return kept


def _rlimits(limits: Limits) -> list[tuple[int, int]]:
    return [(resource.RLIMIT_CPU, limits.cpu_time_s), (resource.RLIMIT_AS, limits.address_space_bytes),
            (resource.RLIMIT_NPROC, limits.max_processes), (resource.RLIMIT_FSIZE, limits.file_size_bytes),
            (resource.RLIMIT_NOFILE, limits.open_files), (resource.RLIMIT_CORE, 0)]


def _limit_process(pid: int, limits: Limits, cgroup_procs: list[str]) -> None:
    """Give a running (still blocked) process the rlimits and the cgroup, as _child_setup does in a child."""
    for res, value in _rlimits(limits):
        resource.prlimit(pid, res, (value, value))
    join_cgroups(cgroup_procs, pid=pid)


def _child_setup(limits: Limits, uid: int | None, cgroup_procs: list[str] | None = None):
    """Runs in the forked child before exec: cgroups, rlimits (as root they cannot be raised back), then uid."""

    def setup() -> None:
        if cgroup_procs:
            join_cgroups(cgroup_procs)
        # If the server dies (even by SIGKILL) the command's main process dies with it.
        if _libc is not None:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        for res, value in _rlimits(limits):
            resource.setrlimit(res, (value, value))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return setup


class Isolation:
    """Builds and runs sandboxed commands. Construct once per server; it probes the host."""

    def __init__(self, options: ServerOptions, probe_dir: Path, cgroups: Cgroups | None = None,
                 cgroup_note: str = "", disk_quota: bool = False) -> None:
        self.options = options
        self.cgroups = cgroups
        self.disk_quota = disk_quota
        self.limits = Limits.from_options(options)
        self._is_root = os.geteuid() == 0
        self._bwrap = shutil.which("bwrap")
        self._setpriv = shutil.which("setpriv")
        self._unshare = shutil.which("unshare")
        self._env_bin = shutil.which("env")
        self._python_bin = str(Path(sys.executable).parent)
        notes: list[str] = []
        self.backend = "process"
        self.uid: int | None = None  # uid the command runs as; None = the server's own
        self._bwrap_mode = ""  # "setpriv" (root, real uid drop) or "userns" (uid mapped in a user namespace)
        self._process_netns = False
        self._seccomp, self._seccomp_how = build_filter() if options.isolation != "process" else (None, "")
        want_uid = options.sandbox_uid if options.sandbox_uid >= 0 and self._is_root else None
        if options.isolation in ("auto", "bwrap"):
            reason = self._probe_bwrap(probe_dir, want_uid)
            if reason is None:
                pass
            elif options.isolation == "bwrap":
                raise RuntimeError(f"isolation='bwrap' requested but bubblewrap is unusable: {reason}")
            else:
                notes.append(f"bubblewrap unavailable ({reason}); using plain subprocess + rlimits")
        if self.backend == "process":
            if want_uid is not None:
                if self._probe_process(probe_dir, want_uid):
                    self.uid = want_uid
                else:
                    notes.append(f"uid {want_uid} cannot run {sys.executable}; commands run as the server's uid")
            elif self._is_root is False:
                notes.append("server is not root: commands run as the server's uid")
            self._process_netns = self._is_root and self._probe_unshare(probe_dir)
        if self.backend != "bwrap":
            self._seccomp = None  # bwrap applies it; the process backend has no filter
        elif self._seccomp is None:
            notes.append(f"no seccomp filter: {self._seccomp_how}")
        if cgroup_note and cgroups is None:
            notes.append(f"no per-sandbox process and memory limits: {cgroup_note}")
        if self.host_uid() == 0 and not options.allow_root_commands:
            raise RuntimeError(
                "commands would run as root (" + "; ".join(notes or ["sandbox_uid=-1"]) + "): install bubblewrap "
                "(scripts/install_bwrap.sh), make the interpreter readable for other uids, or pass "
                "--allow-root-commands to accept it")
        self.report = self._make_report(notes)

    # ---- uids ----------------------------------------------------------------------------------
    @property
    def per_sandbox_uids(self) -> bool:
        """Each sandbox slot gets its own real uid (root server, uid dropped by setpriv or setuid)."""
        return self.uid is not None and (self.backend == "process" or self._bwrap_mode == "setpriv")

    def command_uid(self, slot: int) -> int | None:
        """uid the sandbox in ``slot`` runs its commands as (inside its namespaces); None: the server's."""
        if self.uid is None:
            return None
        return self.uid + slot if self.per_sandbox_uids else self.uid

    def host_uid(self) -> int:
        """uid that commands have on the host (outside any user namespace)."""
        if self.uid is None or (self.backend == "bwrap" and self._bwrap_mode == "userns"):
            return os.geteuid()
        return self.uid

    # ---- probing -------------------------------------------------------------------------------
    def _probe(self, argv: list[str], cwd: Path, uid: int | None) -> bool:
        launch = self.launch(cwd, argv, self.base_env(cwd), network=False, uid=self.uid)
        try:
            with _args_file(launch.bwrap_args, launch.seccomp) as fds:
                done = subprocess.run(launch.host_argv(fds), cwd=cwd, env=launch.env,
                                      capture_output=True, timeout=30, pass_fds=fds,
                                      preexec_fn=_child_setup(self.limits, uid), start_new_session=True)
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0 and done.stdout.strip() == b"ok"

    def _probe_bwrap(self, probe_dir: Path, uid: int | None) -> str | None:
        if self._bwrap is None:
            return "bwrap not found on PATH"
        check = [sys.executable, "-c", "import pytest; print('ok')"]
        can_setpriv = self._setpriv is not None and self._env_bin is not None
        modes = (["setpriv", "userns"] if can_setpriv else ["userns"]) if uid is not None else ["userns"]
        self.backend = "bwrap"
        for mode in modes:
            self._bwrap_mode, self.uid = mode, uid
            if self._probe(check, probe_dir, None):  # bwrap itself switches uid
                return None
        self.backend, self._bwrap_mode, self.uid = "process", "", None
        return "a test command failed inside bubblewrap (user namespaces disabled?)"

    def _probe_process(self, probe_dir: Path, uid: int) -> bool:
        os.chown(probe_dir, uid, uid)
        return self._probe([sys.executable, "-c", "import pytest; print('ok')"], probe_dir, uid)

    def _probe_unshare(self, probe_dir: Path) -> bool:
        if self._unshare is None:
            return False
        self._process_netns = True
        ok = self._probe([sys.executable, "-c", "print('ok')"], probe_dir, None)
        self._process_netns = False
        return ok

    def _make_report(self, notes: list[str]) -> IsolationReport:
        uid = self.uid if self.uid is not None else os.geteuid()
        enforced = self._enforced(uid)
        limits = ["rlimits per process: CPU time, address space, file size, open files, core dumps off",
                  *(f"{name}: {how}" for name, how in enforced.items() if how and "RLIMIT" not in how)]
        missing = [f"not enforced: {name}" for name, how in enforced.items() if how is None]
        scope = self._bwrap_scope if self.backend == "bwrap" else self._process_scope
        namespaces, isolated, not_isolated = scope(limits, missing)
        return IsolationReport(backend=self.backend, uid=uid, namespaces=namespaces,
                               network_isolated_by_default=self.backend == "bwrap" or self._process_netns,
                               process_limit_enforced=enforced["processes_per_sandbox"] is not None,
                               enforced=enforced, isolated=isolated, not_isolated=not_isolated, notes=notes)

    def _enforced(self, uid: int) -> dict[str, str | None]:
        """Each limit the report names, with how it is enforced here (None: it is not)."""
        options = self.options
        cgroup = f"cgroup v{self.cgroups.version}" if self.cgroups is not None else None
        per_uid = self.per_sandbox_uids
        enforced: dict[str, str | None] = {
            "processes_per_sandbox": (f"{cgroup} pids.max={options.max_processes}" if cgroup else
                                      f"RLIMIT_NPROC={options.max_processes} of the sandbox's own uid" if per_uid
                                      else None),
            "memory_per_sandbox": f"{cgroup} memory limit {options.memory_bytes} bytes" if cgroup else None,
            "memory_all_sandboxes": (f"{cgroup} memory limit {self.cgroups.total_memory_bytes} bytes on the parent "
                                     "group of every sandbox" if self.cgroups is not None else None),
            "processes_all_sandboxes": (f"{cgroup} pids.max={self.cgroups.total_pids} on the parent group of every "
                                        "sandbox" if self.cgroups is not None and self.cgroups.total_pids else None),
            "sandboxes": f"at most {options.max_sandboxes} at once (scoring sandboxes included)",
            "disk_per_sandbox": f"tmpfs of {options.disk_bytes} bytes on the sandbox folder" if self.disk_quota else None,
            "tmp_per_command": (f"private tmpfs /tmp of {options.tmp_bytes} bytes" if self.backend == "bwrap"
                                else "inside the sandbox folder (TMPDIR)" if self.disk_quota else None),
            "uid_per_sandbox": f"uids {uid}..{uid + options.max_sandboxes - 1}" if per_uid else None,
            "judge_uid_per_sandbox": (f"uids {uid + options.max_sandboxes}..{uid + 2 * options.max_sandboxes - 1} "
                                      "(exec command when peer_command is set)" if per_uid else None),
            "address_space_per_process": f"RLIMIT_AS={options.address_space_bytes}",
            "cpu_time_per_process": f"RLIMIT_CPU={options.cpu_time_s}",
            "file_size": f"RLIMIT_FSIZE={options.file_size_bytes}",
            "seccomp": self._seccomp_how if self._seccomp is not None else None,
        }
        return enforced

    def _bwrap_scope(self, limits: list[str], missing: list[str]) -> tuple[list[str], list[str], list[str]]:
        """(namespaces, what is isolated, what is not) with the bwrap backend."""
        namespaces = ["mount", "pid", "ipc", "uts", "network (unless network=true)"]
        if self._bwrap_mode == "userns":
            namespaces.append("user")
        isolated = [
            "private workspace directory per sandbox, mounted at /workspace",
            "filesystem: only /usr, the Python prefix and a few /etc files (read-only), private /tmp",
            "processes: own pid namespace; the whole tree dies with the command or on timeout",
            "network: none by default (own network namespace with loopback only)",
            "host side: bwrap and setpriv start with a fixed environment; options via a memfd, not argv",
            *limits,
        ]
        not_isolated = [
            "kernel: shared with the host (namespaces, not a VM); kernel exploits escape",
            "CPU: no CPU quota; only RLIMIT_CPU per process and the wall-clock timeout",
            *(["/proc/self/mountinfo shows the host path of the workspace bind mount"] if not self.disk_quota else []),
            "network=true shares the host network namespace",
            *missing,
        ]
        return namespaces, isolated, not_isolated

    def _process_scope(self, limits: list[str], missing: list[str]) -> tuple[list[str], list[str], list[str]]:
        """(namespaces, what is isolated, what is not) with the process backend."""
        namespaces = ["network (unless network=true)"] if self._process_netns else []
        isolated = [
            "private workspace directory per sandbox (the working directory, not a chroot)",
            "processes: own session; the process group is killed on timeout, escaped daemons by marker",
            *limits,
            *(["network: none by default (unshare --net)"] if self._process_netns else []),
        ]
        not_isolated = [
            *(["privileges: commands run as root (allow_root_commands)"] if self.host_uid() == 0 else []),
            "filesystem: the command sees the host filesystem with the permissions of its uid",
            *([] if self.per_sandbox_uids else ["other sandboxes' workspaces: all sandboxes share one uid"]),
            "kernel and CPU: no namespaces",
            "network" + ("" if not self._process_netns else " when network=true"),
            *missing,
        ]
        return namespaces, isolated, not_isolated

    # ---- command lines -------------------------------------------------------------------------
    def workdir(self, workspace: Path) -> str:
        return SANDBOX_WORKDIR if self.backend == "bwrap" else str(workspace)

    def base_env(self, workspace: Path, home: Path | None = None) -> dict[str, str]:
        home_dir = "/tmp" if self.backend == "bwrap" else str(home or workspace)
        return {
            "PATH": f"{self._python_bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": home_dir,
            "TMPDIR": home_dir,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }

    @functools.cache  # noqa: B019 - one Isolation per server; the host's layout does not change under it
    def _host_mounts(self) -> list[str]:
        """The read-only host binds, /proc, /dev, /tmp and /etc of every bwrap command: built once (the
        stat and realpath calls cost ~0.5 ms an exec)."""
        cmd: list[str] = []
        cmd += ["--ro-bind", "/usr", "/usr"]
        for top in ("lib", "lib64", "lib32", "bin", "sbin"):
            host = Path("/" + top)
            if host.is_symlink():
                cmd += ["--symlink", os.readlink(host), str(host)]
            elif host.is_dir():
                cmd += ["--ro-bind", str(host), str(host)]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(self.options.tmp_bytes),
                "--tmpfs", "/tmp", "--perms", "0755", "--dir", "/etc"]
        for etc in ("passwd", "group", "hosts", "nsswitch.conf", "ld.so.cache", "localtime", "resolv.conf"):
            cmd += ["--ro-bind-try", f"/etc/{etc}", f"/etc/{etc}"]
        python_dirs = _python_dirs()
        # Mount points bwrap creates for the binds below default to mode 0700 when it runs as root:
        # make them traversable for the sandbox uid.
        ancestors = sorted({str(p) for d in python_dirs for p in Path(d).parents if str(p) != "/"})
        for ancestor in ancestors:
            cmd += ["--perms", "0755", "--dir", ancestor]
        for d in python_dirs:
            cmd += ["--ro-bind", d, d]
        if self.options.tools_dir:  # harnesses installed by the operator, never by a task: read-only
            cmd += ["--ro-bind", self.options.tools_dir, TOOLS_DIR]
        return cmd

    def _bwrap_args(self, workspace: Path, argv: list[str], env: dict[str, str],
                    network: bool, uid: int | None, binds: tuple[tuple[str, str], ...] = ()) -> tuple[list[str], list[str]]:
        """bwrap's options and the command it runs. The options travel through ``--args FD``, never
        argv, so ``/proc/1/cmdline`` inside the sandbox shows ``bwrap --args N -- COMMAND`` and no
        host path (bwrap refuses the command itself inside the args file)."""
        cmd = ["--die-with-parent", "--new-session", "--clearenv",
               "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        if not network:
            cmd.append("--unshare-net")
        cmd += self._host_mounts()
        cmd += ["--bind", str(workspace), SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR]
        for source, target in binds:  # an exec's own (its gateway socket's folder)
            cmd += ["--perms", "0755", "--dir", str(Path(target).parent), "--bind", source, target]
        if self._seccomp is not None:
            cmd += ["--seccomp", _SECCOMP_FD_SLOT]
        if uid is None and self._bwrap_mode == "setpriv":  # the pair launcher switches uids itself
            return cmd, argv
        if uid is not None and self._bwrap_mode == "setpriv":
            assert self._setpriv is not None and self._env_bin is not None
            # setpriv runs as root inside the mount namespace: it starts with an empty environment
            # and the command's environment is applied by `env -i` only after the uid drop.
            assignments = [f"{name}={value}" for name, value in env.items()]
            return cmd, [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                         "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
                         self._env_bin, "-i", *assignments, *argv]
        cmd += ["--unshare-user", "--cap-drop", "ALL"]
        if uid is not None:
            cmd += ["--uid", str(uid), "--gid", str(uid)]
        for name, value in env.items():  # applied by bwrap after it dropped every capability
            cmd += ["--setenv", name, value]
        return cmd, argv

    def judge_uid(self, slot: int) -> int | None:
        """uid of an exec's command when it has a ``peer_command`` (the peer gets ``command_uid``):
        one no sandbox runs as, so the peer cannot signal, trace or read it. None: no uid switch."""
        if not self.per_sandbox_uids:
            return None
        assert self.uid is not None
        return self.uid + self.options.max_sandboxes + slot

    def pair_argv(self, argv: list[str], peer: list[str], env: dict[str, str], slot: int,
                  lazy_peer: bool = False) -> list[str]:
        """The launcher (``pair_launch``) that starts ``argv`` as the judge uid and ``peer`` as the sandbox's
        (with ``lazy_peer``, at ``argv``'s first write to it)."""
        spec = {"command": argv, "peer": peer, "env": env, "judge_uid": self.judge_uid(slot),
                "peer_uid": self.command_uid(slot) if self.per_sandbox_uids else None, "lazy_peer": lazy_peer}
        return [sys.executable, "-I", "-S", "-c", _PAIR_LAUNCH_SOURCE, pair_spec_arg(spec)]

    def launch(self, workspace: Path, argv: list[str], env: dict[str, str], network: bool,
               uid: int | None, peer: list[str] | None = None, slot: int = 0, lazy_peer: bool = False,
               binds: tuple[tuple[str, str], ...] = ()) -> Launch:
        """How to start ``argv``: the host argv, the host environment and, for bwrap, its argument file.
        With ``peer``, the pair launcher runs as the server's uid (root) and switches each process's uid."""
        if peer is not None:
            argv = self.pair_argv(argv, peer, env, slot, lazy_peer)
            if self.per_sandbox_uids:
                uid = None
        if self.backend == "bwrap":
            assert self._bwrap is not None
            options, command = self._bwrap_args(workspace, argv, env, network, uid, binds)
            return Launch([self._bwrap, "--args", _ARGS_FD_SLOT, "--", *command], dict(HOST_ENV), options, self._seccomp)
        if peer is not None:  # the launcher itself starts with the fixed host environment
            return Launch(argv, dict(HOST_ENV), None) if network or not self._process_netns else \
                Launch([self._unshare or "unshare", "--net", "--", *argv], dict(HOST_ENV), None)
        if self._process_netns and not network:
            # unshare runs as the server's uid; the rlimits and the uid drop happen before it execs.
            return Launch([self._unshare or "unshare", "--net", "--", *argv], env, None)
        return Launch(argv, env, None)

    def owner(self, slot: int) -> int | None:
        """uid that must own the workspace files of the sandbox in ``slot`` (None: leave as created)."""
        if not self.per_sandbox_uids:
            # With a user namespace, the sandbox uid maps back to the server's uid outside.
            return None
        return self.command_uid(slot)

    # ---- running -------------------------------------------------------------------------------
    async def run(self, workspace: Path, home: Path, argv: list[str], *, stdin: bytes | None,
                  env: dict[str, str], timeout_s: float, network: bool, slot: int = 0,
                  cgroup: str | None = None, peer: list[str] | None = None, lazy_peer: bool = False,
                  binds: tuple[tuple[str, str], ...] = ()) -> RunResult:
        """Run ``argv`` in ``workspace``; ``binds``: extra ``(host folder, sandbox path)`` binds (bwrap only)."""
        marker = uuid.uuid4().hex
        full_env = {**self.base_env(workspace, home), **env}
        if self.backend == "process":
            full_env[_MARKER_VAR] = marker
        command_uid = self.command_uid(slot)
        launch = self.launch(workspace, argv, full_env, network, command_uid, peer, slot, lazy_peer, binds)
        uid = command_uid if self.backend == "process" else None  # bwrap drops the uid itself
        if peer is not None and self.per_sandbox_uids:
            uid = None  # the pair launcher switches uids
        procs = self.cgroups.procs_files(cgroup) if self.cgroups is not None and cgroup else []
        start = time.monotonic()
        stdin_mode = subprocess.PIPE if stdin else subprocess.DEVNULL
        try:
            if launch.bwrap_args is not None:
                proc = await self._start_bwrap(launch, workspace, stdin_mode, procs)
            else:
                proc = await self._start_process(launch, workspace, stdin_mode, uid, procs)
        except (FileNotFoundError, PermissionError) as exc:
            # argv[0] not found / not executable (process backend): report like a shell would.
            return RunResult(127, b"", f"{exc}\n".encode(), False, False, time.monotonic() - start)
        except OSError as exc:  # E2BIG and the like: the command could not start, as a shell says it
            return RunResult(126, b"", f"cannot execute: {exc.strerror or exc}\n".encode(), False, False,
                             time.monotonic() - start)
        return await self._collect(proc, stdin, timeout_s, marker, start)

    async def _start_process(self, launch: Launch, workspace: Path, stdin_mode: int, uid: int | None,
                             procs: list[str]) -> subprocess.Popen:
        def spawn() -> subprocess.Popen:
            return subprocess.Popen(launch.argv, cwd=workspace, env=launch.env, start_new_session=True,
                                    stdin=stdin_mode, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    preexec_fn=_child_setup(self.limits, uid, procs))

        # In a worker thread: fork, the child's setup and exec block the caller until exec;
        # on the event loop that would serialise every command of every sandbox.
        return await asyncio.get_running_loop().run_in_executor(_SPAWN_POOL, spawn)

    async def _collect(self, proc: subprocess.Popen, stdin: bytes | None, timeout_s: float, marker: str,
                       start: float) -> RunResult:
        """Feed stdin, capture both outputs up to the limit, wait for the exit or the timeout, then kill
        the command's whole tree (background children must not outlive it)."""
        limit = self.options.output_limit_bytes
        out, err = _Capture(limit), _Capture(limit)
        assert proc.stdout is not None and proc.stderr is not None
        loop = asyncio.get_running_loop()
        readers = [out.drain(loop, proc.stdout), err.drain(loop, proc.stderr)]
        feeder = _feed(loop, proc, stdin) if stdin else None
        exited = _exit_future(loop, proc)
        timed_out = False
        try:
            try:
                await asyncio.wait_for(asyncio.shield(exited), timeout=timeout_s)
            except TimeoutError:
                timed_out = True
            finally:
                # Kill the tree even on normal exit: background children must not outlive their command.
                self._kill_tree(proc.pid, marker)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await exited
            duration = time.monotonic() - start
            await asyncio.wait(readers, timeout=_DRAIN_GRACE_S)
        finally:
            for pipe in (proc.stdout, proc.stderr, proc.stdin):
                if pipe is not None and not pipe.closed:
                    loop.remove_reader(pipe.fileno())
                    loop.remove_writer(pipe.fileno())
                    pipe.close()
            for future in [*readers, *([feeder] if feeder else [])]:
                future.cancel()
        exit_code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return RunResult(exit_code=-signal.SIGKILL if timed_out else exit_code, stdout=out.data(),
                         stderr=err.data(), timed_out=timed_out, truncated=out.truncated or err.truncated,
                         duration_s=duration)

    async def _start_bwrap(self, launch: Launch, workspace: Path, stdin_mode: int,
                           procs: list[str]) -> subprocess.Popen:
        """Start bwrap without a pre-exec hook (so Python can vfork: ~0.2 ms instead of ~4 ms to fork
        the server), then, while bwrap's sandboxed child waits on ``--block-fd``, give that child
        (its pid comes on ``--info-fd``) the rlimits and the cgroup, and let it go. Everything the
        command starts inherits both. bwrap's own ``--die-with-parent`` replaces the death signal."""
        assert launch.bwrap_args is not None
        info_read, info_write = os.pipe()
        block_read, block_write = os.pipe()
        args = [*launch.bwrap_args, "--info-fd", str(info_write), "--block-fd", str(block_read)]
        try:
            with _args_file(args, launch.seccomp) as fds:
                proc = subprocess.Popen(launch.host_argv(fds), cwd=workspace, env=launch.env,
                                        start_new_session=True, stdin=stdin_mode, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, pass_fds=(*fds, info_write, block_read))
        except BaseException:
            for fd in (info_read, info_write, block_read, block_write):
                os.close(fd)
            raise
        os.close(info_write)
        os.close(block_read)
        try:
            child = (await _read_json_object(info_read)).get("child-pid")
            if child is not None:  # None: bwrap failed before its child; it exits with its error
                # A worker thread: moving a task between cgroups can wait for an RCU grace period (~ms).
                await asyncio.get_running_loop().run_in_executor(_SPAWN_POOL, _limit_process, child, self.limits,
                                                                 procs)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.write(block_write, b"1")
            os.close(block_write)
        return proc

    def _kill_tree(self, pgid: int, marker: str) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        if self.backend == "process":
            kill_marked_processes(marker)


@contextlib.contextmanager
def _args_file(args: list[str] | None, seccomp: bytes | None = None):
    """Yields () or (fd, ...) of a memfd holding ``args`` NUL-terminated, for ``bwrap --args FD``,
    then, with ``seccomp``, a memfd of that program whose number replaces ``_SECCOMP_FD_SLOT``."""
    if args is None:
        yield ()
        return
    fds: list[int] = []
    try:
        if seccomp is not None:
            fds.append(write_memfd(seccomp))
            args = [str(fds[0]) if arg is _SECCOMP_FD_SLOT else arg for arg in args]
        fds.insert(0, os.memfd_create("bwrap-args"))
        os.write(fds[0], b"".join(arg.encode() + b"\0" for arg in args))
        os.lseek(fds[0], 0, os.SEEK_SET)
        yield tuple(fds)
    finally:
        for fd in fds:
            os.close(fd)


def kill_marked_processes(marker: str) -> int:
    """Kill processes whose environment carries ``SANDBOX_EXEC_MARKER=marker`` (daemons that called setsid)."""
    needle = f"{_MARKER_VAR}={marker}".encode()
    killed = 0
    for _ in range(3):  # a daemon may fork while we scan; repeat until nothing is left
        found = 0
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                if needle in (pid_dir / "environ").read_bytes().split(b"\0"):
                    os.kill(int(pid_dir.name), signal.SIGKILL)
                    found += 1
            except (OSError, ValueError):
                continue
        killed += found
        if not found:
            break
    return killed


def _read_available(fd: int) -> bytes | None:
    """What a non-blocking ``fd`` holds now: None if nothing yet, ``b""`` at EOF (or a read error)."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


async def _read_json_object(fd: int) -> dict:
    """Read one JSON object from ``fd`` on the event loop (complete object or EOF), then close ``fd``.
    Does not wait for EOF: bwrap's sandboxed child may still hold the write end."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    done: asyncio.Future = loop.create_future()

    def on_readable() -> None:
        chunk = _read_available(fd)
        if chunk is None:
            return
        if chunk:
            chunks.append(chunk)
            with contextlib.suppress(ValueError):
                parsed = json.loads(b"".join(chunks))
                if isinstance(parsed, dict) and not done.done():
                    done.set_result(parsed)
        elif not done.done():
            done.set_result({})

    loop.add_reader(fd, on_readable)
    try:
        return await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def _exit_future(loop: asyncio.AbstractEventLoop, proc: subprocess.Popen) -> asyncio.Future:
    """Resolves (after reaping) when ``proc`` exits: a pidfd on the loop, no thread per command."""
    done: asyncio.Future = loop.create_future()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (old kernel): a thread waits instead
        waiting = asyncio.ensure_future(asyncio.to_thread(proc.wait))
        waiting.add_done_callback(lambda _: done.done() or done.set_result(proc.returncode))
        return done

    def on_exit() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if not done.done():
            done.set_result(proc.wait())

    loop.add_reader(pidfd, on_exit)
    return done


class _Capture:
    """Keeps the first ``limit`` bytes of a stream and keeps draining the rest so the child never blocks."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False

    def drain(self, loop: asyncio.AbstractEventLoop, pipe) -> asyncio.Future:
        """Read ``pipe`` on the loop until EOF; the future resolves then."""
        fd = pipe.fileno()
        os.set_blocking(fd, False)
        done: asyncio.Future = loop.create_future()

        def on_readable() -> None:
            chunk = _read_available(fd)
            if chunk is None:
                return
            if not chunk:
                loop.remove_reader(fd)
                if not done.done():
                    done.set_result(None)
                return
            self._keep(chunk)

        loop.add_reader(fd, on_readable)
        return done

    def _keep(self, chunk: bytes) -> None:
        room = self.limit - self.size
        if room > 0:
            self.chunks.append(chunk[:room])
            self.size += min(room, len(chunk))
        if len(chunk) > room:
            self.truncated = True

    def data(self) -> bytes:
        return b"".join(self.chunks)


def _feed(loop: asyncio.AbstractEventLoop, proc: subprocess.Popen, data: bytes) -> asyncio.Future:
    """Write ``data`` to the child's stdin without blocking the loop, then close it."""
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    os.set_blocking(fd, False)
    view = memoryview(data)
    done: asyncio.Future = loop.create_future()

    def finish() -> None:
        with contextlib.suppress(ValueError, OSError):
            loop.remove_writer(fd)
        with contextlib.suppress(OSError):
            proc.stdin.close()
        if not done.done():
            done.set_result(None)

    def on_writable() -> None:
        nonlocal view
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            return
        except OSError:  # the child closed its stdin or exited
            view = view[:0]
        if not view:
            finish()

    loop.add_writer(fd, on_writable)
    return done
