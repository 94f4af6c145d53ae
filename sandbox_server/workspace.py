"""Workspace files, confined to the sandbox directory.

A client path must be relative, without ``..`` or NUL, and must resolve (after symlinks) inside the
workspace. The final walk opens every component with O_NOFOLLOW relative to the previous directory,
so a symlink swapped in by a running command between the check and the open is refused, not followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class WorkspaceError(Exception):
    """A refused file request; ``code`` and ``status`` go to the HTTP error body."""

    def __init__(self, code: str, status: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.message = message


def check_relative(path: str) -> PurePosixPath:
    """Validate a client path lexically; returns it as a PurePosixPath."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise WorkspaceError("invalid_path", 400, f"invalid path {path!r}: empty or contains NUL")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise WorkspaceError("invalid_encoding", 400, f"path {path!r} is not valid Unicode text") from None
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise WorkspaceError("path_escape", 400, f"absolute paths are refused: {path!r}")
    if any(part == ".." for part in pure.parts):
        raise WorkspaceError("path_escape", 400, f"'..' is refused in paths: {path!r}")
    parts = [p for p in pure.parts if p != "."]
    if not parts:
        raise WorkspaceError("invalid_path", 400, f"path {path!r} names the workspace itself")
    return PurePosixPath(*parts)


def _confined_parts(root: Path, path: str) -> list[str]:
    """Resolve symlinks; refuse anything that lands outside ``root``. Returns the resolved relative parts."""
    rel = check_relative(path)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, rel))
    if os.path.commonpath([real_root, real]) != real_root or real == real_root:
        raise WorkspaceError("path_escape", 400, f"path {path!r} resolves outside the workspace")
    return list(PurePosixPath(os.path.relpath(real, real_root)).parts)


def _open_dir(root: Path, parts: list[str], *, create: bool, owner: int | None) -> int:
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts:
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                if owner is not None:
                    os.chown(part, owner, owner, dir_fd=fd, follow_symlinks=False)
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _refuse(path: str, exc: OSError) -> WorkspaceError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return WorkspaceError("path_escape", 400, f"path {path!r} goes through a symlink or a non-directory")
    if isinstance(exc, FileNotFoundError):
        return WorkspaceError("file_not_found", 404, f"no such file: {path!r}")
    if isinstance(exc, IsADirectoryError):
        return WorkspaceError("is_a_directory", 400, f"{path!r} is a directory")
    return WorkspaceError("invalid_path", 400, f"cannot access {path!r}: {exc.strerror}")


def read_bytes(root: Path, path: str, max_bytes: int) -> bytes:
    parts = _confined_parts(root, path)
    try:
        dir_fd = _open_dir(root, parts[:-1], create=False, owner=None)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise _refuse(path, exc) from exc
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if stat.S_ISDIR(info.st_mode):
            raise WorkspaceError("is_a_directory", 400, f"{path!r} is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise WorkspaceError("invalid_path", 400, f"{path!r} is not a regular file")
        if info.st_size > max_bytes:
            raise WorkspaceError("payload_too_large", 413,
                                 f"{path!r} has {info.st_size} bytes, more than the limit {max_bytes}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise WorkspaceError("payload_too_large", 413, f"{path!r} is larger than the limit {max_bytes}")
    return data


def write_bytes(root: Path, path: str, data: bytes, *, owner: int | None, max_bytes: int) -> None:
    if len(data) > max_bytes:
        raise WorkspaceError("payload_too_large", 413,
                             f"content for {path!r} has {len(data)} bytes, more than the limit {max_bytes}")
    parts = _confined_parts(root, path)
    try:
        dir_fd = _open_dir(root, parts[:-1], create=True, owner=owner)
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise _refuse(path, exc) from exc
    with os.fdopen(fd, "wb") as f:
        if owner is not None:
            os.fchown(f.fileno(), owner, owner)
        f.write(data)


def list_files(root: Path, max_files: int) -> list[str]:
    """Regular files under ``root`` (relative POSIX paths, sorted); symlinks are not followed or listed."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        for name in filenames:
            full = base / name
            with contextlib.suppress(OSError):
                if stat.S_ISREG(full.lstat().st_mode):
                    found.append(full.relative_to(root).as_posix())
            if len(found) > max_files:
                raise WorkspaceError("payload_too_large", 413, f"workspace holds more than {max_files} files")
    return sorted(found)


def chown_tree(root: Path, owner: int) -> None:
    os.chown(root, owner, owner, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames]:
            os.chown(os.path.join(dirpath, name), owner, owner, follow_symlinks=False)


def copy_tree(src: Path, dst: Path, *, owner: int | None) -> None:
    """Copy a workspace (symlinks copied as symlinks, never followed)."""
    shutil.copytree(src, dst, symlinks=True, ignore=_special_files)
    if owner is not None:
        chown_tree(dst, owner)


def _special_files(directory: str, names: list[str]) -> list[str]:
    """FIFOs, sockets and devices are skipped: opening a FIFO to copy it would block the server."""
    skipped = []
    for name in names:
        with contextlib.suppress(OSError):
            mode = os.lstat(os.path.join(directory, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                skipped.append(name)
    return skipped
