"""PID 1 of one sandboxed execution (stdlib only; run as ``python -I -S -c <this source> SPEC_FD
STATUS_FD`` -- no host path in its command line -- by ``unshare --net --pid --fork --mount --ipc
--uts --kill-child``, as root, in the fresh namespaces). Not imported by the package: it runs in
the sandbox, the runner passes its source.

Compiles the code, builds the default-deny view and pivots into it, forks the program (rlimits,
sandbox uid, no_new_privs, seccomp last), waits, kills what is left and reports on STATUS_FD.
Any failure of the set-up reports ``setup_error`` before the program runs: never a weaker
sandbox. Step by step: docs/rewards.md ("PID 1").
"""

import atexit
import builtins
import ctypes
import json
import os
import resource
import signal
import stat
import sys
import threading
import traceback

SETUP_FAILED = 121
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_BIND = 1, 2, 4, 8, 32, 1024, 4096
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
ROOT = "/tmp"  # the new root's mount point (a host path; this mount namespace only)
# Host-wide facts and counters the namespace's /proc still shows (other uids' keys and locks,
# memory, load, pressure, I/O, the kernel's command line, tunables): each read-only and empty
# inside -- files covered by /dev/null, directories by an empty tmpfs. Counters another
# execution moves would be a channel between executions.
PROC_MASK_FILES = ("key-users", "keys", "locks", "loadavg", "meminfo", "vmstat", "zoneinfo", "buddyinfo",
                   "pagetypeinfo", "slabinfo", "diskstats", "interrupts", "softirqs", "schedstat", "swaps",
                   "uptime", "stat", "cmdline", "kallsyms", "modules", "timer_list", "sched_debug", "vmallocinfo",
                   "iomem", "ioports", "partitions", "latency_stats", "kcore", "kmsg", "sysrq-trigger")
PROC_MASK_DIRS = ("pressure", "sys", "irq", "bus", "acpi", "scsi", "driver", "fs", "tty", "asound")
DEVICES = (("null", 3), ("zero", 5), ("full", 7), ("random", 8), ("urandom", 9))  # char 1:minor
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    enc = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]),
           f"mount {source} on {target} ({fstype})")


def _bind_ro(host, inside):
    _mount(host, inside, None, MS_BIND)
    # noatime: a read through the view leaves no trace on the host's inode for another execution to stat
    _mount(None, inside, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOATIME)


def _expose(path, bound):
    """Make ``path`` resolve under ROOT as on the host: symlinked components become the same
    symlinks, the real file or directory is bound read-only (once: ``bound`` holds what is)."""
    parts = os.path.normpath(path).strip("/").split("/")
    cur = ""
    for i, part in enumerate(parts):
        host = f"{cur}/{part}"
        if os.path.islink(host):
            target = os.readlink(host)
            inside = ROOT + host
            if not os.path.lexists(inside):
                os.makedirs(os.path.dirname(inside), exist_ok=True)
                os.symlink(target, inside)
            rest = "/".join(parts[i + 1:])
            _expose(os.path.normpath(os.path.join(cur or "/", target, rest)), bound)
            return
        cur = host
    if not os.path.exists(cur) or any(cur == b or cur.startswith(b + "/") for b in bound):
        return
    inside = ROOT + cur
    if os.path.isdir(cur):
        os.makedirs(inside, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        open(inside, "w").close()
    _bind_ro(cur, inside)
    bound.append(cur)


def build_view(spec, syscalls):
    """Step 1 of the module docstring (ends inside the new root, cwd /)."""
    os.umask(0o022)
    _mount("tmpfs", ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    bound = []
    for path in spec["expose"]:
        _expose(path, bound)
    for path in spec["mask"]:  # e.g. the interpreter's site-packages, inside its bound stdlib
        _mount("tmpfs", ROOT + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,nr_inodes=1,mode=755")
    dev = ROOT + "/dev"
    os.mkdir(dev)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name, minor in DEVICES:
        os.mknod(f"{dev}/{name}", 0o666 | stat.S_IFCHR, os.makedev(1, minor))
        os.chmod(f"{dev}/{name}", 0o666)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    _mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    os.mkdir(ROOT + "/proc")
    # hidepid=invisible: the program (its own uid) does not see PID 1 (root) at all
    _mount("proc", ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
    for name in PROC_MASK_FILES:
        if os.path.isfile(f"{ROOT}/proc/{name}"):
            _mount(dev + "/null", f"{ROOT}/proc/{name}", None, MS_BIND)  # a device: no nodev
            _mount(None, f"{ROOT}/proc/{name}", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    for name in PROC_MASK_DIRS:
        if os.path.isdir(f"{ROOT}/proc/{name}"):
            _mount("tmpfs", f"{ROOT}/proc/{name}", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   "size=4k,nr_inodes=1,mode=555")
    tmp = ROOT + "/tmp"
    os.mkdir(tmp)
    _mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec['tmpfs_mb']}m,nr_inodes={spec['tmpfs_inodes']},mode=755")
    os.mkdir(tmp + "/work", 0o700)
    os.chown(tmp + "/work", spec["uid"], spec["gid"])
    with open(tmp + "/main.py", "w") as f:  # root-owned, read-only for the program
        f.write(spec["code"])
    os.chmod(tmp + "/main.py", 0o444)
    _mount(None, ROOT, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    os.chdir(ROOT)
    _check(_libc.syscall(syscalls["pivot_root"], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def run_program(spec, code, syscalls, status_fd, setup_fd):
    """Step 2 of the module docstring (in the forked child; never returns). The program runs in
    this forked interpreter (no second interpreter start: half the cost of an execution), as
    ``python -I -S /tmp/main.py`` would run it: ``__main__`` globals, sys.argv, the standard
    library on sys.path, tracebacks without our frames, exit status 1 on an exception."""
    os.close(status_fd)
    lim = spec["limits"]
    for name, soft, hard in (("RLIMIT_CPU", lim["cpu_s"], lim["cpu_s"] + 1),  # SIGXCPU first, not SIGKILL
                             ("RLIMIT_AS", lim["address_space_bytes"], None), ("RLIMIT_FSIZE", lim["file_bytes"], None),
                             ("RLIMIT_NOFILE", lim["open_files"], None), ("RLIMIT_NPROC", lim["processes"], None),
                             ("RLIMIT_CORE", 0, None), ("RLIMIT_MSGQUEUE", 0, None)):
        resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    # A fresh anonymous session keyring: the worker's (the trainer's) is inherited otherwise.
    if _libc.syscall(syscalls["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) < 0 and ctypes.get_errno() != 38:
        raise OSError(ctypes.get_errno(), "join a fresh session keyring")
    os.chdir("/tmp/work")
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp/work",
                       "TMPDIR": "/tmp/work", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"})
    sys.argv = ["/tmp/main.py"]
    sys.path[:] = ["/tmp", *sys.path[1:]]  # not this file's directory
    sys.dont_write_bytecode = True
    bpf = bytes.fromhex(spec["seccomp_bpf"])
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.addressof(buf))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp filter")
    os.close(setup_fd)  # set-up done: from here on, nothing the program does can report set-up errors

    status = 0
    try:
        exec(code, {"__name__": "__main__", "__file__": "/tmp/main.py", "__builtins__": builtins})
        for t in threading.enumerate():  # the interpreter waits for non-daemon threads at exit
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            sys.stderr.write(f"{e.code}\n")
            status = 1
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # drop our exec frame
        traceback.print_exception(type(e), e, tb)
        status = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    os._exit(status & 0xFF)


def main():
    with os.fdopen(int(sys.argv[1]), "rb") as f:
        spec = json.loads(f.read())
    status_fd = int(sys.argv[2])

    def report(**observed):
        os.write(status_fd, json.dumps(observed).encode())
        os.close(status_fd)

    try:
        code = compile(spec["code"], "/tmp/main.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:  # ValueError: a null byte in the source
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        report(syntax_error=True)
        sys.exit(1)
    syscalls = spec["syscalls"]
    try:
        build_view(spec, syscalls)
    except OSError as e:
        sys.stderr.write(f"sandbox set-up failed: {e}\n")
        report(setup_error=str(e))
        sys.exit(SETUP_FAILED)
    setup_r, setup_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(setup_r)
        try:
            run_program(spec, code, syscalls, status_fd, setup_w)
        except BaseException as e:
            os.write(setup_w, f"{e}".encode() or b"?")
            sys.stderr.write(f"sandbox set-up failed: {e}\n")
        os._exit(SETUP_FAILED)
    os.close(setup_w)
    # Our copies of the runner's pipes: close them, so that the runner sees EOF once the
    # program (and anything it started) is gone.
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    status = None
    while status is None:
        try:
            wpid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if wpid == pid:
            status = st
    for _ in range(100):  # the daemons the program left behind (kill(-1) spares PID 1 itself)
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            break
        try:
            while os.waitpid(-1, 0):
                pass
        except ChildProcessError:
            break
    setup_error = os.read(setup_r, 4096).decode(errors="replace")  # the child's write end is closed
    if setup_error:
        report(setup_error=setup_error)
    elif status is None:
        report(setup_error="the program's process vanished")
    elif os.WIFSIGNALED(status):
        report(signal=os.WTERMSIG(status))
    else:
        report(exit=os.WEXITSTATUS(status))
    os._exit(0)


if __name__ == "__main__":
    main()
