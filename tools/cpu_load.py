"""A bounded CPU-saturating job: the load beside which timing-sensitive tests must still pass.

    python tools/cpu_load.py --seconds 900 --procs 2 -- <command...>

Starts ``--procs`` busy-looping processes (default: one per core), runs the command, and stops the
burners when it ends -- or when ``--seconds`` have passed, whichever comes first (each burner
also exits by itself at that deadline, so nothing outlives a killed parent). Exits with the
command's status. ``make test-failover-load`` runs the failover test this way.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time


def _burn(deadline: float) -> None:
    x = 0
    while time.monotonic() < deadline:
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=900.0, help="the burners stop after this long at most")
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    deadline = time.monotonic() + args.seconds
    burners = [mp.Process(target=_burn, args=(deadline,), daemon=True) for _ in range(args.procs)]
    for p in burners:
        p.start()
    try:
        return subprocess.call(cmd) if cmd else (time.sleep(max(deadline - time.monotonic(), 0)) or 0)
    finally:
        for p in burners:
            p.terminate()
            p.join()


if __name__ == "__main__":
    sys.exit(main())
