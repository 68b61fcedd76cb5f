"""Stand-in inference server for launcher tests: answers GET /health on --host:--port.

    python tests/launch_standins/engine.py --host 127.0.0.1 --port 30000 --marker M [--die-after 2]

``--marker`` only tags the command line so tests can look for leftovers with ``ps``.
``--die-after S`` exits with code 7 S seconds after it starts serving (an engine crash); with
``--index I --die-index J`` only the engine whose index equals J does.
"""

import argparse
import http.server
import sys
import threading
import time


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        body = b"ok"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--marker", default="")
    p.add_argument("--die-after", type=float, default=None)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--die-index", type=int, default=None)
    p.add_argument("--lifetime", type=float, default=300.0, help="never outlive a broken test")
    a = p.parse_args()
    srv = http.server.ThreadingHTTPServer((a.host, a.port), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(f"standin engine serving {a.host}:{a.port}", flush=True)
    t0 = time.monotonic()
    if a.die_index is not None and a.die_index != a.index:
        a.die_after = None
    while time.monotonic() - t0 < a.lifetime:
        if a.die_after is not None and time.monotonic() - t0 > a.die_after:
            print("standin engine crashing on purpose", flush=True)
            return 7
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
