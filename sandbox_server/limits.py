"""Per-sandbox limits that rlimits cannot give: processes and memory (cgroups), disk (a sized tmpfs),
and the workspace root's lifetime (a lock, cleaned at start).

rlimits are per process (RLIMIT_AS, RLIMIT_CPU) or per uid (RLIMIT_NPROC): with one uid for every
sandbox, one sandbox holding ~500 processes made ``fork`` fail in all the others. Here each sandbox
gets its own cgroup (v1 ``pids``/``memory`` hierarchies, or v2 ``pids.max``/``memory.max``, detected)
and, when the server is root, its own uid and its own tmpfs mounted on its directory, so a flood in
one sandbox stops at that sandbox. What could not be set up is reported, never assumed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import re
import signal
import struct
import time
from pathlib import Path

from sandbox_server.options import UID_MAX
from sandbox_server.workspace import remove_tree

log = logging.getLogger("sandbox_server")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_MS_NOSUID, _MS_NODEV = 0x2, 0x4
_MNT_DETACH = 0x2
_SANDBOX_DIR = re.compile(r"^[0-9a-f]{32}$")
try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:
    _libc = None


# ---- cgroups ----------------------------------------------------------------------------------------
class Cgroups:
    """One cgroup per sandbox under a parent named after the workspace root, on v1 or v2.

    ``procs_files(name)`` are the ``cgroup.procs`` files a command's first process writes its pid to
    before exec (the whole tree then stays inside)."""

    def __init__(self, version: int, parents: dict[str, Path], pids_max: int, memory_bytes: int,
                 total_memory_bytes: int = 0, total_pids: int = 0) -> None:
        self.version = version
        self.total_pids = total_pids  # 0: no limit on all sandboxes' processes together
        self.total_memory_bytes = total_memory_bytes or host_memory_bytes() * 3 // 4
        self.parents = parents  # controller ("pids", "memory"; "unified" on v2) -> parent directory
        self.pids_max = pids_max
        self.memory_bytes = memory_bytes

    @classmethod
    def detect(cls, root_dir: Path, pids_max: int, memory_bytes: int,
               total_memory_bytes: int = 0, total_pids: int = 0) -> tuple[Cgroups | None, str]:
        """(cgroups, how) or (None, why not). Removes the groups a killed server left under the same root."""
        tag = "agentrl-" + hashlib.sha256(str(root_dir).encode()).hexdigest()[:12]
        v1 = {c: _CGROUP_ROOT / c for c in ("pids", "memory")}
        if all((p / "cgroup.procs").exists() for p in v1.values()):
            made = cls(1, {c: p / tag for c, p in v1.items()}, pids_max, memory_bytes, total_memory_bytes, total_pids)
        elif "pids" in _read(_CGROUP_ROOT / "cgroup.controllers").split():
            made = cls(2, {"unified": _CGROUP_ROOT / tag}, pids_max, memory_bytes, total_memory_bytes, total_pids)
        else:
            return None, "no cgroup v1 pids/memory hierarchy and no cgroup v2 pids controller"
        try:
            made._prepare()
            made.create("probe")
            made.remove("probe")
        except OSError as exc:
            return None, f"cgroup v{made.version} not writable: {exc.strerror or exc}"
        return made, f"cgroup v{made.version}"

    def _prepare(self) -> None:
        for parent in self.parents.values():
            if parent.exists():
                for child in sorted(p for p in parent.iterdir() if p.is_dir()):
                    self._kill_and_remove(child)  # left by a server that was killed
            parent.mkdir(exist_ok=True)
        if self.version == 2:
            _write(_CGROUP_ROOT / "cgroup.subtree_control", "+pids +memory")
            _write(self.parents["unified"] / "cgroup.subtree_control", "+pids +memory")
            _write(self.parents["unified"] / "memory.max", str(self.total_memory_bytes))
        else:  # children count against the parent's limit (memory.use_hierarchy, 1 on every kernel >= 5)
            _write(self.parents["memory"] / "memory.limit_in_bytes", str(self.total_memory_bytes))
        if self.total_pids:  # pids.max is hierarchical on v1 and v2
            _write(self.parents["pids" if self.version == 1 else "unified"] / "pids.max", str(self.total_pids))

    def _dirs(self, name: str) -> list[Path]:
        return [parent / name for parent in self.parents.values()]

    def create(self, name: str) -> list[str]:
        for directory in self._dirs(name):
            directory.mkdir(exist_ok=True)
        if self.version == 1:
            _write(self.parents["pids"] / name / "pids.max", str(self.pids_max))
            memory = self.parents["memory"] / name
            _write(memory / "memory.limit_in_bytes", str(self.memory_bytes))
            if (memory / "memory.memsw.limit_in_bytes").exists():  # swap counts too
                _write(memory / "memory.memsw.limit_in_bytes", str(self.memory_bytes))
        else:
            group = self.parents["unified"] / name
            _write(group / "pids.max", str(self.pids_max))
            _write(group / "memory.max", str(self.memory_bytes))
            if (group / "memory.swap.max").exists():
                _write(group / "memory.swap.max", "0")
        return [str(d / "cgroup.procs") for d in self._dirs(name)]

    def procs_files(self, name: str) -> list[str]:
        return [str(d / "cgroup.procs") for d in self._dirs(name)]

    def memory_procs_file(self, name: str) -> str:
        """The ``cgroup.procs`` of the sandbox's memory group (where written pages are charged)."""
        return str(self.parents["memory" if self.version == 1 else "unified"] / name / "cgroup.procs")

    def remove(self, name: str) -> None:
        for directory in self._dirs(name):
            self._kill_and_remove(directory)

    @staticmethod
    def _kill_and_remove(directory: Path) -> None:
        for _ in range(50):
            pids = [int(p) for p in _read(directory / "cgroup.procs").split()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            try:
                directory.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("cannot remove cgroup %s: %s", directory, exc)
                    return
            time.sleep(0.02)
        log.warning("cgroup %s still busy; left behind", directory)


def total_processes(max_sandboxes: int, max_processes: int, requested: int = 0) -> int:
    """The limit on all sandboxes' processes together: ``requested``, or (0) the smaller of what the
    sandboxes may hold and half of ``kernel.pid_max`` (the host and the server need pids too).
    ``ValueError`` naming the option when it cannot fit below ``kernel.pid_max``."""
    pid_max = int(_read(Path("/proc/sys/kernel/pid_max")) or 4_194_304)
    total = requested or min(max_sandboxes * max_processes, pid_max // 2)
    if total >= pid_max:
        raise ValueError(f"total_processes ({total}) must be below this host's kernel.pid_max ({pid_max}): "
                         "the sandboxes together would take every pid the host has")
    if max_processes > total:
        raise ValueError(f"max_processes ({max_processes}) exceeds total_processes ({total}"
                         f"{'' if requested else ', half of kernel.pid_max'}): lower it or raise total_processes")
    return total


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def join_cgroups(procs_files: list[str], pid: int | None = None) -> None:
    """Move ``pid`` (default: this process, e.g. a forked child before exec) into the sandbox's cgroups."""
    pid_text = str(os.getpid() if pid is None else pid).encode()
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, pid_text)
        finally:
            os.close(fd)


# ---- disk: a sized tmpfs per sandbox -----------------------------------------------------------------
def mount_tmpfs(target: Path, size_bytes: int, max_inodes: int) -> None:
    """Mount a tmpfs of ``size_bytes`` on ``target`` (root only): writes past it fail with ENOSPC."""
    if _libc is None:
        raise OSError(errno.ENOSYS, "no libc mount()")
    options = f"size={size_bytes},nr_inodes={max_inodes},mode=0700".encode()
    if _libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def unmount(target: Path) -> None:
    if _libc is not None and _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point
            log.warning("cannot unmount %s: %s", target, os.strerror(err))


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below ``root``, deepest first (from /proc/self/mountinfo)."""
    prefix = str(root).rstrip("/") + "/"
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


# ---- the sandbox uids -----------------------------------------------------------------------------
# In a folder only root can write (no other user can create, plant or hold it): the first of these.
UID_LOCK_FOLDERS = (Path("/run"), Path("/var/lib"))
UID_LOCK_NAME = "lightning-agentrl-uids.lock"


def _writable_by_others(folder: Path) -> bool:
    info = folder.lstat()
    return folder.is_symlink() or info.st_uid != os.geteuid() or bool(info.st_mode & 0o022)


def uid_lock_file() -> Path:
    """The uid lock in the first of :data:`UID_LOCK_FOLDERS` that exists and only this uid can write."""
    for folder in UID_LOCK_FOLDERS:
        if folder.is_dir() and not _writable_by_others(folder):
            return folder / UID_LOCK_NAME
    raise RuntimeError(f"none of {', '.join(map(str, UID_LOCK_FOLDERS))} is a folder that only uid "
                       f"{os.geteuid()} can write: nowhere to lock the sandbox uids")


def claim_uids(first: int, count: int, lock_file: Path | None = None) -> tuple[int, int]:
    """Claim ``count`` consecutive uids starting at ``first`` or, when another live server on this host
    holds some of them, at the next free range above: two servers never share a uid. A shared uid
    would share RLIMIT_NPROC (one server's fork bomb stops the other's sandboxes), and with different
    ``max_sandboxes`` one server's sandbox uid would be the other's judge uid. The claim is an
    open-file-description lock on bytes ``[first uid, first uid + count)`` of ``lock_file``, held for
    the server's life and released even on SIGKILL. Servers in another mount namespace (another
    container) see another file: give them distinct ``sandbox_uid`` ranges. Returns the first uid and
    the lock's fd (close it to release). ``lock_file``: :func:`uid_lock_file` unless given."""
    lock_file = lock_file or uid_lock_file()
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise RuntimeError(f"cannot open the uid lock {lock_file}: {err}") from err
    try:
        base = first
        while base + count - 1 <= UID_MAX:
            request = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, base, count, 0)  # struct flock
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
                return base, fd
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):  # not "held by another"
                    raise
            base += count
        raise RuntimeError(f"no {count} free uids between {first} and {UID_MAX}: other sandbox servers hold them")
    except BaseException:
        os.close(fd)
        raise


# ---- the workspace root ---------------------------------------------------------------------------
def default_root() -> Path:
    """A stable root per server uid; ``-N`` suffixes when other live servers hold the first ones."""
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"lightning-agentrl-sandboxes-{os.geteuid()}"
    return base


def claim_root(root: Path, *, stable_default: bool) -> tuple[Path, int]:
    """Lock ``root`` for this server (flock, released even on SIGKILL) and empty it: whatever a killed
    server left (workspaces, tmpfs mounts) goes now. For the default root, a root held by a live
    server is skipped for ``root-1``, ``root-2``, ...; an explicit root held by one is an error."""
    for index in range(0, 1000 if stable_default else 1):
        candidate = root if index == 0 else root.with_name(f"{root.name}-{index}")
        candidate.mkdir(parents=True, exist_ok=True)
        lock = os.open(candidate / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            continue
        clean_root(candidate)
        return candidate.resolve(), lock
    raise RuntimeError(f"root_dir {root} is in use by another running sandbox server")


def clean_root(root: Path) -> None:
    """Remove what a server leaves in its root (sandbox folders, probe folders, their mounts) and
    nothing else, so a root_dir pointed at the wrong folder loses no one's files."""
    ours = [entry for entry in root.iterdir() if _SANDBOX_DIR.match(entry.name) or entry.name.startswith("probe-")]
    for point in mounts_under(root):
        if any(point == entry or entry in point.parents for entry in ours):
            unmount(point)
    for entry in ours:
        remove_tree(entry)
