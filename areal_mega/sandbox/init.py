"""PID 1 of one sandboxed execution (stdlib only; run as ``python -I -S init.py FD`` by
``unshare --net --pid --fork --mount --mount-proc --ipc --uts --kill-child``, as root, in the fresh
namespaces). Not imported by the package: it runs in the sandbox, the runner starts it by path.

It reads its spec (JSON) from the pipe whose fd is its argument, then:

1. builds the mount view: a private size-limited tmpfs over /tmp (the only writable place: the
   work dir /tmp/work belongs to the sandbox uid) and over /var/tmp, /dev/shm, /run (hides the
   host's unix sockets: a network namespace does not isolate filesystem sockets) and each
   ``hide`` path (the trainer's home, its caches and secrets) -- the interpreter's prefix is
   bound back read-only if it lived under a hidden path; then remounts every other mount
   read-only. Everything happens in this mount namespace only (unshare makes it private).
2. forks the program: rlimits (CPU, address space, file size, open files, processes, no core
   files), no supplementary groups, the sandbox's own gid/uid (RLIMIT_NPROC counts per uid and
   does not bind root: the uid is what makes the process limit real), no_new_privs (setuid
   binaries cannot give root back), an environment of PATH/LANG/HOME/TMPDIR only, cwd
   /tmp/work, stdin / stdout / stderr inherited from the runner's pipes; then runs the code
   in that forked interpreter (``run_program``).
3. waits for the program's main process; then SIGKILLs everything else left in the namespace
   (a double-forked daemon was re-parented to us) and exits with the program's status
   (128 + signal when it was killed by a signal). When we exit the kernel kills whatever is
   left in the PID namespace; when the runner kills unshare, --kill-child SIGKILLs us.

Any failure of the set-up exits 121 with the reason on stderr (the runner reports
``sandbox_error``), before the program runs: never a weaker sandbox.
"""

import ctypes
import json
import os
import resource
import signal
import sys

SETUP_FAILED = 121
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MNT_DETACH = 2
_FLAG_NAMES = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data=None):
    enc = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target} ({fstype}): {os.strerror(err)}")


def _mount_points():
    """(mount point, per-mount flags) of this namespace, from /proc/self/mountinfo."""
    out = []
    for line in open("/proc/self/mountinfo").read().splitlines():
        f = line.split()
        point = f[4].encode().decode("unicode_escape")  # \040 etc.
        flags = 0
        for opt in f[5].split(","):
            flags |= _FLAG_NAMES.get(opt, 0)
        out.append((point, flags))
    return out


def _tmpfs(path, size_mb, mode):
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode={mode:o}")


def build_view(spec):
    """Steps 1 of the module docstring; returns the work dir."""
    uid, gid = spec["uid"], spec["gid"]
    _tmpfs("/tmp", spec["tmpfs_mb"], 0o755)
    stage = "/tmp/.prefix"
    prefix = os.path.realpath(spec["python_prefix"])
    hidden = [os.path.realpath(p) for p in spec["hide"] if os.path.isdir(p)]
    rebind = any(prefix == h or prefix.startswith(h.rstrip("/") + "/") for h in hidden)
    if rebind:  # keep the interpreter reachable at its own path after its parent is hidden
        os.mkdir(stage)
        _mount(prefix, stage, None, MS_BIND | MS_REC)
    for path in ["/var/tmp", "/dev/shm", "/run", *hidden]:
        if os.path.isdir(path) and not os.path.islink(path):
            _tmpfs(path, 1, 0o755)
    if rebind:
        os.makedirs(prefix, mode=0o755, exist_ok=True)
        _mount(stage, prefix, None, MS_BIND | MS_REC)
        if _libc.umount2(stage.encode(), MNT_DETACH) != 0:
            raise OSError(ctypes.get_errno(), "umount stage")
        os.rmdir(stage)
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    os.chown(work, uid, gid)
    with open("/tmp/main.py", "w") as f:  # root-owned, read-only for the program
        f.write(spec["code"])
    os.chmod("/tmp/main.py", 0o444)
    keep_writable = {"/tmp", "/proc", "/dev/pts"}
    for point, flags in _mount_points():
        if point in keep_writable or point.startswith("/proc/"):
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError:
            if not os.path.exists(point):  # shadowed by a mount above it: unreachable anyway
                continue
            raise
    os.chmod("/tmp", 0o755)
    return work


def run_program(spec, work):
    """Step 2 of the module docstring (in the forked child; never returns). The program runs in
    this forked interpreter (no second interpreter start: half the cost of an execution), as
    ``python -I -S /tmp/main.py`` would run it: ``__main__`` globals, sys.argv, the standard
    library on sys.path, tracebacks without our frames, exit status 1 on an exception."""
    lim = spec["limits"]
    for name, value in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["memory_bytes"]),
                        ("RLIMIT_FSIZE", lim["file_bytes"]), ("RLIMIT_NOFILE", lim["open_files"]),
                        ("RLIMIT_NPROC", lim["processes"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        os._exit(SETUP_FAILED)
    os.chdir(work)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work,
                       "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"})
    sys.argv = ["/tmp/main.py"]
    sys.path[:] = ["/tmp", *sys.path[1:]]  # not this file's directory
    sys.dont_write_bytecode = True
    import atexit
    import builtins
    import threading
    import traceback

    status = 0
    try:
        exec(compile(spec["code"], "/tmp/main.py", "exec"),
             {"__name__": "__main__", "__file__": "/tmp/main.py", "__builtins__": builtins})
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
    spec = json.loads(os.fdopen(int(sys.argv[1]), "rb").read())
    try:
        work = build_view(spec)
    except OSError as e:
        sys.stderr.write(f"sandbox set-up failed: {e}\n")
        sys.exit(SETUP_FAILED)
    pid = os.fork()
    if pid == 0:
        try:
            run_program(spec, work)
        except BaseException as e:
            sys.stderr.write(f"sandbox set-up failed: {e}\n")
        os._exit(SETUP_FAILED)
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
    code = os.waitstatus_to_exitcode(status) if status is not None else SETUP_FAILED
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
