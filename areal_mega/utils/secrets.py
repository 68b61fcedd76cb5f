"""Per-launch secrets (the inference servers' API key), kept out of command lines and logs.

A launch writes its key to ``<run_dir>/secrets/`` (directory 0700, files 0600): ``api_key`` (the
key, read by the learners through ``inference.api_key_file``) and ``sglang.yaml`` (``api-key:
<key>``, which SGLang reads with ``--config``; SGLang's own ``--api-key`` flag would put the key
in every ``ps`` listing and in the launcher's logs).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["KEY_FILE", "SGLANG_CONFIG", "read_api_key", "sglang_key_config", "write_api_key", "write_private"]

KEY_FILE = "api_key"
SGLANG_CONFIG = "sglang.yaml"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600 from creation: no window in
    which another user could open it), atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def sglang_key_config(key: str) -> str:
    """The SGLang ``--config`` YAML that sets the API key (quoted: keys may look like numbers)."""
    return f'api-key: "{key}"\n'


def write_api_key(directory: Path, key: str | None = None) -> str:
    """Write ``key`` (a fresh random one when None) as both files in ``directory``; returns it."""
    # Hex: SGLang's --config turns the YAML into argv, where a key starting with "-" (which
    # token_urlsafe can produce) would parse as an option ("--api-key: expected one argument").
    key = key or secrets.token_hex(32)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    write_private(directory / KEY_FILE, key + "\n")
    write_private(directory / SGLANG_CONFIG, sglang_key_config(key))
    return key


def read_api_key(path: str | Path) -> str:
    """The key in ``path`` (an ``api_key`` file); one clear error if it is missing or empty."""
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"api_key_file: cannot read {path}: {e.strerror}") from None
    if not key:
        raise ValueError(f"api_key_file: {path} is empty")
    return key
