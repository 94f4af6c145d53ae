"""The seccomp filter every bwrap command runs under (``bwrap --seccomp FD``): the system calls a
sandboxed program never needs and an attacker wants, refused with ``EPERM`` (``ENOSYS`` for
``clone3``, so libc falls back to ``clone``, whose flags the filter can read). Everything else is
allowed: the namespaces, uids, cgroups and rlimits do the containing; this takes away the kernel
surface they leave reachable. docs/sandbox.md lists the calls with the same reasons.

Built with libseccomp (``pyseccomp``), which resolves the names for the host's architecture and
refuses other ABIs (x32 on x86_64). Without libseccomp the server runs without the filter and says
so on /v1/health (``enforced.seccomp: null``).
"""

from __future__ import annotations

import errno
import os
import tempfile

# name -> why a sandboxed command is refused it
REFUSED_SYSCALLS: dict[str, str] = {
    **dict.fromkeys(("unshare", "setns"), "new or foreign namespaces: a user namespace gives every capability "
                    "inside it (mount a tmpfs over /tmp, reach kernel code unprivileged users cannot)"),
    **dict.fromkeys(("mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
                     "fsmount", "fspick", "mount_setattr"), "changing the filesystem view"),
    **dict.fromkeys(("keyctl", "add_key", "request_key"), "kernel keyrings are per uid, not per namespace: a "
                    "key one sandbox stores is read by the next sandbox of that uid"),
    **dict.fromkeys(("io_uring_setup", "io_uring_enter", "io_uring_register"), "io_uring: a large kernel surface "
                    "with a history of privilege escalations, and work that bypasses per-call checks"),
    **dict.fromkeys(("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
                    "reading or steering other processes"),
    **dict.fromkeys(("bpf", "perf_event_open", "userfaultfd"), "kernel programs, performance counters and page "
                    "fault handling: side channels and common exploit primitives"),
    **dict.fromkeys(("kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
                     "swapon", "swapoff", "acct", "quotactl", "syslog", "iopl", "ioperm", "settimeofday",
                     "clock_settime", "clock_adjtime", "adjtimex", "vhangup", "lookup_dcookie"),
                    "host administration (needs privileges the command never has; refused outright)"),
    **dict.fromkeys(("open_by_handle_at", "name_to_handle_at"), "file handles open files outside the "
                    "mounts the sandbox sees"),
    **dict.fromkeys(("fanotify_init",), "watching the filesystem of others"),
}
# socket families a sandboxed program never needs and that reach past its network namespace: AF_VSOCK (40) talks
# to the hypervisor and other guests of a VM host whatever the namespace; AF_KEY (15) is IPsec key management
REFUSED_SOCKET_FAMILIES: dict[int, str] = {40: "AF_VSOCK: the hypervisor and other VM guests, outside any network "
                                               "namespace", 15: "AF_KEY: IPsec key management"}
# clone flags that make a namespace (CLONE_NEWNS ... CLONE_NEWTIME): clone with any of them is refused
_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                          0x00000080)


def build_filter() -> tuple[bytes | None, str]:
    """(the classic BPF program bwrap takes, how) or (None, why not)."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as exc:  # the package, or libseccomp itself, is missing
        return None, f"libseccomp unavailable ({type(exc).__name__}: {exc})"
    refuse = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in REFUSED_SYSCALLS:
        try:
            rules.add_rule(refuse, name)
        except (RuntimeError, ValueError, OSError):
            continue  # not a system call on this architecture (iopl on arm64)
    for flag in _CLONE_NAMESPACE_FLAGS:
        rules.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # its flags are behind a pointer: use clone
    for family in REFUSED_SOCKET_FAMILIES:
        for call in ("socket", "socketpair"):
            rules.add_rule(refuse, call, seccomp.Arg(0, seccomp.EQ, family))
    with tempfile.TemporaryFile() as program:
        rules.export_bpf(program)
        program.seek(0)
        return program.read(), f"seccomp filter refusing {len(REFUSED_SYSCALLS)} system calls and namespace clones"


def write_memfd(program: bytes) -> int:
    """A memfd holding ``program``, read from its start by bwrap (``--seccomp FD``)."""
    fd = os.memfd_create("bwrap-seccomp")
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
