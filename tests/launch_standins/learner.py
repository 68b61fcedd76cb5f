"""Stand-in learner rank for launcher tests (run under torchrun; imports no torch).

    torchrun ... tests/launch_standins/learner.py --engines '[h:p,...]' --out DIR --marker M \
        [--die-rank R --exit-code 3] [--hold 4]

Every rank GETs /health from every engine and writes DIR/rank<R>.json with what it saw, then
holds for --hold seconds -- or, with --stop-file F, until F appears, then writes
DIR/saved<R> (its "checkpoint") and exits 0, as the trainer does. With --die-rank R, rank R prints a last words line to stderr and exits
with --exit-code while the other ranks keep running (until the launcher stops them).
"""

import argparse
import json
import os
import socket
import sys
import time
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engines", required=True, help="YAML-style list [host:port,...]")
    p.add_argument("--out", required=True)
    p.add_argument("--marker", default="")
    p.add_argument("--die-rank", type=int, default=None)
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--hold", type=float, default=2.0)
    p.add_argument("--stop-file", default=None)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    engines = [e for e in a.engines.strip("[]").split(",") if e]
    seen = {}
    for e in engines:
        try:
            with urllib.request.urlopen(f"http://{e}/health", timeout=10) as r:
                seen[e] = r.status
        except OSError as err:  # an engine may have crashed on purpose
            seen[e] = f"down: {err}"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "hostname": socket.gethostname(),
                   "master": os.environ["MASTER_ADDR"], "engines": seen,
                   "omp": os.environ.get("OMP_NUM_THREADS")}, f)
    print(f"rank {rank}/{world} saw {len(seen)} engines", flush=True)
    if a.die_rank is not None:
        if rank == a.die_rank:
            time.sleep(0.5)
            print(f"rank {rank} last words: simulated failure {a.marker}", file=sys.stderr, flush=True)
            return a.exit_code
        time.sleep(300)  # a peer blocked in a collective: only the launcher can end it
    deadline = time.monotonic() + a.hold
    while time.monotonic() < deadline:
        if a.stop_file and os.path.exists(a.stop_file):
            open(os.path.join(a.out, f"saved{rank}"), "w").close()
            return 0
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
