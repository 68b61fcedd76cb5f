"""Process logs with one header per attempt, so a failure's tail shows only the current attempt.

A log file is appended to by every start of its process: launcher reruns (requeue, kill and
rerun) and server restarts by the inference pool. Each start first writes

    === attempt 3 at 2026-12-01T22:04:05Z: <command>

(:func:`open_attempt`), and :func:`attempt_tail` returns the last lines AFTER the last such
header: an error of attempt 2 never shows up as the cause of attempt 3's failure.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import BinaryIO, Sequence

HEADER = "=== attempt "


def _count_attempts(path: Path) -> int:
    n, tail = 0, b""
    marker = ("\n" + HEADER).encode()
    try:
        with open(path, "rb") as f:
            if f.read(len(HEADER)) == HEADER.encode():
                n += 1
            f.seek(0)
            while chunk := f.read(1 << 20):
                data = tail + chunk
                n += data.count(marker)
                tail = data[-(len(marker) - 1):]
    except OSError:
        return 0
    return n


def open_attempt(path: str | Path, command: Sequence[str] | str) -> BinaryIO:
    """``path`` opened for appending, a header for this attempt (its number, UTC time, the
    command; redact secrets before) written and flushed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = _count_attempts(path) + 1
    f = open(path, "ab")
    lead = b"\n" if f.tell() else b""
    cmd = command if isinstance(command, str) else " ".join(map(str, command))
    f.write(lead + f"{HEADER}{n} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {cmd}\n".encode())
    f.flush()
    return f


def attempt_tail(path: str | Path, num_lines: int, max_line_chars: int = 0) -> str:
    """The last ``num_lines`` lines of the current (last) attempt of the log at ``path``, its
    header included when it fits; ``max_line_chars`` > 0 shortens longer lines."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    starts = [i for i, line in enumerate(lines) if line.startswith(HEADER)]
    if starts:
        lines = lines[starts[-1]:]
    lines = lines[-num_lines:]
    if max_line_chars > 0:
        lines = [ln if len(ln) <= max_line_chars else ln[:max_line_chars] + " ..." for ln in lines]
    return "\n".join(lines)
