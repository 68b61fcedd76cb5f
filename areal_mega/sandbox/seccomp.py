"""The sandbox's seccomp filter: an allowlist of the system calls CPython programs need.

``filter_bpf(allow_memfd) -> bytes`` compiles it with libseccomp (``pyseccomp``) in the sandbox
worker, once per worker; ``jail.py`` loads the raw BPF with ``prctl(PR_SET_SECCOMP)`` just before
the code runs. Everything not listed fails with EPERM; a foreign architecture kills the process.
What is denied and why: docs/rewards.md ("The seccomp filter").
"""

from __future__ import annotations

import errno
import socket
import tempfile

ALLOWED = (
    # files and descriptors
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
    "open", "openat", "openat2", "creat", "close", "close_range", "lseek", "dup", "dup2", "dup3",
    "truncate", "ftruncate", "fallocate",
    "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2",
    "getdents", "getdents64", "getcwd", "chdir", "fchdir", "rename", "renameat", "renameat2", "mkdir",
    "mkdirat", "rmdir", "link", "linkat", "unlink", "unlinkat", "symlink", "symlinkat", "readlink",
    "readlinkat", "chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat", "umask",
    "utime", "utimes", "utimensat", "futimesat", "getxattr", "lgetxattr", "fgetxattr", "listxattr",
    "llistxattr", "flistxattr", "sendfile", "copy_file_range", "splice", "tee", "pipe", "pipe2", "ioctl",
    "select", "pselect6", "poll", "ppoll", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
    "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2", "signalfd", "signalfd4", "timerfd_create",
    "timerfd_settime", "timerfd_gettime",
    # memory
    "brk", "mmap", "munmap", "mremap", "mprotect", "mlock", "munlock",
    "mlock2", "membarrier", "get_mempolicy",
    # processes, threads, signals (in the execution's own PID namespace)
    "fork", "vfork", "execve", "execveat", "exit", "exit_group", "wait4", "waitid", "kill", "tkill",
    "tgkill", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait",
    "rt_sigsuspend", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "sigaltstack", "pause", "pidfd_open",
    "pidfd_send_signal", "getpid", "getppid", "gettid", "getpgid", "setpgid", "getpgrp", "getsid", "setsid",
    "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups", "setuid", "setgid",
    "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid", "capget",
    "prctl", "arch_prctl", "set_tid_address", "set_robust_list", "get_robust_list", "rseq", "futex",
    "futex_waitv", "sched_yield", "sched_getaffinity", "sched_setaffinity", "sched_getparam",
    "sched_getscheduler", "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval",
    "getpriority", "setpriority", "getrlimit", "setrlimit", "prlimit64", "getrusage", "times", "uname",
    "sysinfo", "getrandom", "restart_syscall",
    # time
    "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday", "time", "alarm",
    "getitimer", "setitimer", "timer_create", "timer_settime", "timer_gettime", "timer_getoverrun",
    "timer_delete",
    # sockets (which families: see FAMILIES; a fresh network namespace holds only "lo", down)
    "connect", "accept", "accept4", "bind", "listen", "shutdown", "sendto", "recvfrom", "sendmsg", "recvmsg",
    "sendmmsg", "recvmmsg", "getsockname", "getpeername", "setsockopt", "getsockopt",
)
# Cross-execution channels (docs/rewards.md, "Channels between executions"): the page cache of
# the shared read-only view, and watching it. Not in ALLOWED, so EPERM: inotify_*, fanotify_*,
# mincore, cachestat, flock, io_uring_*, userfaultfd, perf_event_open, process_madvise.
NEUTRALISED = ("fadvise64", "readahead", "sync", "syncfs", "fsync", "fdatasync", "sync_file_range", "msync")
"""Advice and flushes: succeed (return 0) and do nothing. Advice may be ignored by definition;
the only writable file system is the execution's own tmpfs, where a flush has nothing to do;
on the read-only view a flush or an eviction would act on the host's (shared) page cache."""
MADVISE_ALLOWED = (0, 1, 2, 4, 8, 10, 11, 14, 15, 16, 17, 18, 19, 102, 103)
"""madvise advice that acts on this process's own mappings only: NORMAL, RANDOM, SEQUENTIAL,
DONTNEED (drops this process's page-table entries; the page cache keeps the pages), FREE (anonymous
only), DONTFORK, DOFORK, HUGEPAGE, NOHUGEPAGE, DONTDUMP, DODUMP, WIPEONFORK, KEEPONFORK,
GUARD_INSTALL, GUARD_REMOVE."""
MADVISE_NEUTRALISED = (3, 12, 13, 20, 21, 25)
"""Advice that acts on memory shared with other processes -- WILLNEED (reads into the page cache),
MERGEABLE / UNMERGEABLE (KSM merges identical pages across processes), COLD, PAGEOUT (age or
reclaim page-cache pages), COLLAPSE (builds huge pages in the page cache): return 0, do nothing.
Every other value (REMOVE, POPULATE_READ/WRITE, which fault file pages in and report failures,
HWPOISON, SOFT_OFFLINE, DONTNEED_LOCKED, unknown ones) is EPERM."""
RWF_NOWAIT = 0x8
"""preadv2/pwritev2 with this flag fail with EAGAIN instead of waiting for a page not in the page
cache: a residency probe. Allowed without it (flags are the 6th argument: fd, iov, iovcnt, pos_l,
pos_h, flags)."""
FCNTL_ALLOWED = (0, 1, 2, 3, 4, 8, 9, 10, 11, 15, 16, 1030, 1031, 1032, 1033, 1034)
"""fcntl commands: DUPFD, GETFD, SETFD, GETFL, SETFL, SETOWN, GETOWN, SETSIG, GETSIG, SETOWN_EX,
GETOWN_EX, DUPFD_CLOEXEC, SETPIPE_SZ, GETPIPE_SZ, ADD_SEALS, GET_SEALS. Not: the record locks
(GETLK/SETLK/SETLKW, OFD_*) and leases (SETLEASE/GETLEASE), which any reader may take on a file of
the shared view and another execution sees, nor NOTIFY (dnotify, a watch on a directory)."""
FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
"""The socket families a program may create (socket, socketpair: AF_UNIX only)."""
NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
CLONE_NEWTIME = 0x80


def syscall_numbers(*names: str) -> dict[str, int]:
    """This machine's numbers of ``names`` (for jail.py's raw ``syscall()`` calls)."""
    import pyseccomp

    arch = pyseccomp.system_arch()
    return {n: pyseccomp.resolve_syscall(arch, n) for n in names}


def filter_bpf(allow_memfd: bool) -> bytes:
    """The compiled filter (struct sock_filter[], 8 bytes each)."""
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ERRNO(errno.EPERM))
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    arch = sc.system_arch()
    for name in ALLOWED + (("memfd_create",) if allow_memfd else ()):
        try:
            number = sc.resolve_syscall(arch, name)
        except Exception:
            continue
        if number >= 0:  # a name this architecture does not have resolves negative
            f.add_rule(sc.ALLOW, name)
    for name in NEUTRALISED:
        if sc.resolve_syscall(arch, name) >= 0:
            f.add_rule(sc.ERRNO(0), name)
    for advice in MADVISE_ALLOWED:
        f.add_rule(sc.ALLOW, "madvise", sc.Arg(2, sc.EQ, advice))
    for advice in MADVISE_NEUTRALISED:
        f.add_rule(sc.ERRNO(0), "madvise", sc.Arg(2, sc.EQ, advice))
    for name in ("preadv2", "pwritev2"):
        f.add_rule(sc.ALLOW, name, sc.Arg(5, sc.MASKED_EQ, RWF_NOWAIT, 0))
    for cmd in FCNTL_ALLOWED:
        f.add_rule(sc.ALLOW, "fcntl", sc.Arg(1, sc.EQ, cmd))
    for fam in FAMILIES:
        f.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, fam))
    f.add_rule(sc.ALLOW, "socketpair", sc.Arg(0, sc.EQ, socket.AF_UNIX))
    f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, NAMESPACE_FLAGS | CLONE_NEWTIME, 0))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()
