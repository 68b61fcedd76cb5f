"""Run one inference server and announce it once it answers: the engine side of the rendezvous.

    python -m areal_mega.launcher.engine_proc --address-file RUN/engines/engine0.json \\
        --host 10.0.0.5 --port 30000 --health-path /health --timeout 1800 -- <server command>

Starts the server command as a child, polls ``http://host:port<health-path>`` (or only the TCP
port when the path is empty) until it answers 200, then writes ``{"host", "port", "url", "pid"}``
to the address file atomically (temp file + rename, so the launcher never reads half a file).
The server runs as its own tree behind the die-with-parent wrapper (``areal_mega.utils.procs``,
the same as the inference pool's servers): if this process is SIGKILLed (srun tearing the step
down, the OOM killer), the server's whole tree dies with it. SIGTERM/SIGINT stop the server's
tree (TERM, grace, KILL); the exit status is the server's. A server that dies or is not ready
within the timeout makes this exit non-zero without writing the file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from areal_mega.utils import procs


def is_ready(host: str, port: int, health_path: str, timeout_s: float = 2.0) -> bool:
    if not health_path:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return True
        except OSError:
            return False
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{health_path}", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def write_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="start an inference server, write its address when ready")
    p.add_argument("--address-file", required=True, type=Path)
    p.add_argument("--host", required=True)
    p.add_argument("--port", required=True, type=int)
    p.add_argument("--health-path", default="/health")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--poll", type=float, default=0.5)
    p.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL of the server")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no server command after --")

    # SGLang logs its arguments, API key included: mask the key of its --config file, if any.
    secret = cmd[cmd.index("--config") + 1] if "--config" in cmd[:-1] else None
    child = procs.spawn(cmd, stdin=None, redact=secret)

    def stop(signum, _frame):
        procs.stop_tree(child, args.grace, sig=signum)
        sys.exit(_exit_code(child.returncode) if child.returncode is not None else 128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    t0 = time.monotonic()
    while not is_ready(args.host, args.port, args.health_path):
        rc = child.poll()
        if rc is not None:
            print(f"engine_proc: server exited with {rc} before it was ready", file=sys.stderr, flush=True)
            return _exit_code(rc) or 1
        if time.monotonic() - t0 > args.timeout:
            print(f"engine_proc: {args.host}:{args.port}{args.health_path} not ready after "
                  f"{args.timeout} s; stopping the server", file=sys.stderr, flush=True)
            procs.stop_tree(child, args.grace)
            return 1
        time.sleep(args.poll)
    url = f"http://{args.host}:{args.port}"
    write_atomic(args.address_file, {"host": args.host, "port": args.port, "url": url,
                                     "pid": procs.main_pid(child), "hostname": socket.gethostname()})
    print(f"engine_proc: {url} ready after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return _exit_code(child.wait())


if __name__ == "__main__":
    sys.exit(main())
