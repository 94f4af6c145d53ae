"""Starts an exec's command and its ``peer_command`` under two uids, joined by three pipes.

Standard library only: the server runs this source as ``python -I -S -c SOURCE SPEC`` inside the
sandbox's namespaces (bubblewrap) or as a plain child (process backend), with the server's uid
(root when uids can be switched). SPEC: ``{"command", "peer", "env", "judge_uid", "peer_uid",
"lazy_peer"}`` in :mod:`marshal`'s format, base64 (the same interpreter writes and reads it; ``json``
would cost this process a third of its start-up, about 8 ms of every scoring run).

- the peer gets the pipes as stdin (requests), stdout (replies) and stderr, and nothing else; it
  runs as ``peer_uid`` (the sandbox's uid);
- the command keeps the exec's stdin/stdout/stderr and gets the other ends on fds 3 (to the peer's
  stdin), 4 (from its stdout) and 5 (from its stderr); it runs as ``judge_uid``, a uid no other
  process of the sandbox has, so the peer cannot signal, trace or read it, nor read its files;
- both lose every capability (a uid switch away from 0 clears them) and get ``no_new_privs``;
- with ``lazy_peer`` the peer starts when the command first writes to it (a command that never asks
  for the peer, such as a hidden check that reads a file, costs one process less; one that reads
  fd 4 or 5 first waits until its timeout); where the kernel has no pidfd (Linux < 5.3) it starts
  with the command, as it always does without ``lazy_peer``;
- this launcher waits for the command, then kills the peer and exits with the command's status.
With a uid of None (a server that is not root) that process keeps the launcher's uid.
"""

import binascii
import ctypes
import fcntl
import marshal
import os
import select
import struct
import sys
import termios

_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_SIGKILL = 9  # signal.SIGKILL on Linux; `import signal` pulls in enum, a quarter of this process's start


def _become(uid, libc):
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _resolve(program, env):
    if "/" in program:
        return program
    for folder in env.get("PATH", "/usr/bin:/bin").split(":"):
        candidate = os.path.join(folder, program)
        if os.access(candidate, os.X_OK):
            return candidate
    return program


def _start(argv, env, uid, fds, libc):
    """fork; in the child: place ``fds`` (target -> source) and close the rest, switch uid, exec."""
    pid = os.fork()
    if pid:
        return pid
    try:
        moved = {target: os.dup(source) for target, source in fds.items()}  # dup first: sources may be targets
        for target, fd in moved.items():
            os.dup2(fd, target)
        os.closerange(max(fds, default=2) + 1, 1 << 16)
        _become(uid, libc)
        os.execve(_resolve(argv[0], env), argv, env)
    except BaseException as exc:  # noqa: BLE001 - report and leave the child, never return into the launcher
        os.write(2, f"cannot start {argv[0]}: {exc}\n".encode())
    os._exit(127)


def _first_request(to_peer_r, command):
    """Wait until the command writes to the peer (True), or exits or closes its end of the pipe
    (False). Where the kernel has no pidfd, True at once: the peer starts with the command."""
    try:
        exited = os.pidfd_open(command)
    except (AttributeError, OSError):
        return True
    try:
        ready = select.select([to_peer_r, exited], [], [])[0]
    finally:
        os.close(exited)
    if to_peer_r not in ready:
        return False
    return struct.unpack("i", fcntl.ioctl(to_peer_r, termios.FIONREAD, b"\0\0\0\0"))[0] > 0


def main():
    spec = marshal.loads(binascii.a2b_base64(sys.argv[1]))
    libc = ctypes.CDLL(None, use_errno=True)
    # Where both run as one uid: no /proc/PID/fd of this launcher (it holds the exec's stdin/stdout)
    # for the peer; and the launcher lets go of them once the command has its copies.
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    env = spec["env"]
    to_peer_r, to_peer_w = os.pipe()
    from_peer_r, from_peer_w = os.pipe()
    err_r, err_w = os.pipe()
    peer_fds = {0: to_peer_r, 1: from_peer_w, 2: err_w}
    lazy = spec.get("lazy_peer", False)
    peer = None if lazy else _start(spec["peer"], env, spec["peer_uid"], peer_fds, libc)
    command = _start(spec["command"], env, spec["judge_uid"],
                     {0: 0, 1: 1, 2: 2, 3: to_peer_w, 4: from_peer_r, 5: err_r}, libc)
    for fd in (to_peer_w, from_peer_r, err_r):
        os.close(fd)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if lazy and _first_request(to_peer_r, command):
        peer = _start(spec["peer"], env, spec["peer_uid"], peer_fds, libc)
    for fd in (to_peer_r, from_peer_w, err_w):
        os.close(fd)
    _, status = os.waitpid(command, 0)
    if peer is not None:
        try:
            os.kill(peer, _SIGKILL)
        except OSError:
            pass
        os.waitpid(peer, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    main()
