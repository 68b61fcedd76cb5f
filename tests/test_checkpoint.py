"""The one checkpoint format (areal_mega/megatron/checkpoint.py): metadata, atomic directories,
resume selection, the conversion tools' errors, and the trainer's real checkpoints.

* pure Python (no process): the metadata writer/reader and its errors, the staging commit,
  ``latest``, which checkpoint a resume picks among complete, incomplete, staging and dangling
  ones;
* ONE 2-rank torchrun launch of tests/dist/checkpoint_run.py (~40 s on 2 busy cores): the
  trainer's own ``save_run_checkpoint`` at TP2 (actor + critic, two steps), the trainer's HF
  export, crash leftovers, ``resume_run_checkpoint`` at PP2 (exact continuation), refusals;
* tools/convert_mcore_to_hf.py (plain python, TP1) on that run's ``checkpoints/latest`` gives
  bit-for-bit the tensors of the run's own ``hf/`` export;
* both tools given bad arguments: exit 2 with one stderr line naming the problem, no traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from areal_mega.megatron.checkpoint import (
    FORMAT,
    LATEST,
    METADATA_FILE,
    CheckpointError,
    _commit,
    find_resume_checkpoint,
    is_complete,
    read_metadata,
    update_latest,
    write_metadata,
)
from tests.support.launch import child_env, run_checked, run_dist_script
from tests.support.numerics import fp32_tol, transformer_reductions


def _meta(**kw) -> dict:
    """Metadata as save_checkpoint writes it for a training checkpoint (model fields abridged)."""
    return {"role": "policy", "contents": ["model", "optimizer"], "model_type": "qwen2", "hf_config": {},
            "dtype": "float32", "padded_vocab_size": 256, "layer_spec": "local", "source_hf_dir": None,
            "saved_layout": "dp=1 pp=1 cp=1 tp=1", "step": 1, "version": 1,
            "train_state": {"num_steps": 1, "lr_scheduler": {}}, "extra": {}, **kw}


def _ckpt(path: Path, complete: bool = True, **kw) -> Path:
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shards")
    if complete:
        write_metadata(path, _meta(**kw))
    return path


def _one_line(msg: str, *needles: str) -> None:
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


# ---------------------------------------------------------------- metadata (pure Python)
def test_metadata_one_file_one_writer_one_reader(tmp_path):
    d = _ckpt(tmp_path / "c", step=7, version=7)
    assert sorted(p.name for p in d.iterdir()) == ["__0_0.distcp", METADATA_FILE]  # no temp file left
    meta = read_metadata(d)
    assert meta["format"] == FORMAT == "areal_mega.checkpoint.v2"
    assert meta["step"] == meta["version"] == 7 and meta["role"] == "policy"
    assert is_complete(d) and not is_complete(tmp_path)
    assert read_metadata(d, role="policy", training=True) == meta


def test_metadata_errors_are_one_line_naming_the_path(tmp_path):
    cases = {}
    cases["missing"] = tmp_path / "nope"
    (tmp_path / "file").write_text("x")
    cases["not a directory"] = tmp_path / "file"
    cases["has no areal_mega.json"] = _ckpt(tmp_path / "incomplete", complete=False)
    bad = _ckpt(tmp_path / "badjson", complete=False)
    (bad / METADATA_FILE).write_text("{half")
    cases["unreadable"] = bad
    future = _ckpt(tmp_path / "future", complete=False)
    (future / METADATA_FILE).write_text(json.dumps({**_meta(), "format": "areal_mega.checkpoint.v3"}))
    cases["has format 'areal_mega.checkpoint.v3'"] = future
    run = tmp_path / "run_checkpoints"
    _ckpt(run / "step000001")
    cases["run's checkpoint directory"] = run
    for what, path in cases.items():
        with pytest.raises(CheckpointError) as e:
            read_metadata(path)
        _one_line(str(e.value), str(path), what.replace("missing", "does not exist"))
    with pytest.raises(CheckpointError, match="holds a critic model, not a policy one"):
        read_metadata(_ckpt(tmp_path / "critic", role="critic"), role="policy")


# ---------------------------------------------------------------- atomic directories and resume
def test_commit_replaces_a_checkpoint_by_rename(tmp_path):
    final, stage = tmp_path / "step000002", _ckpt(tmp_path / ".step000002.partial", step=2)
    _ckpt(final, step=1)
    (final / "stale_only_in_old").write_text("x")
    _commit(stage, final)
    assert read_metadata(final)["step"] == 2 and not (final / "stale_only_in_old").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000002"]  # no staging, no .old left
    _commit(_ckpt(tmp_path / ".step000003.partial", step=3), tmp_path / "step000003")  # nothing to replace
    assert read_metadata(tmp_path / "step000003")["step"] == 3


def test_latest_is_a_relative_symlink_moved_by_rename(tmp_path):
    for s in (1, 2):
        _ckpt(tmp_path / f"step00000{s}", step=s)
        update_latest(tmp_path, tmp_path / f"step00000{s}")
        assert os.readlink(tmp_path / LATEST) == f"step00000{s}"
        assert read_metadata(tmp_path / LATEST)["step"] == s
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step000001", "step000002"]


def test_resume_picks_the_newest_complete_checkpoint(tmp_path):
    assert find_resume_checkpoint(tmp_path / "no_such_dir") == (None, [])
    assert find_resume_checkpoint(tmp_path) == (None, [])
    _ckpt(tmp_path / "step000001", step=1)
    _ckpt(tmp_path / "step000010", step=10)
    _ckpt(tmp_path / "step000011", complete=False)  # died before its metadata
    _ckpt(tmp_path / ".step000012.partial", step=12)  # staging: never a candidate, even with metadata
    _ckpt(tmp_path / "step000009", step=9)
    (tmp_path / "not_a_step").mkdir()
    (tmp_path / LATEST).symlink_to("step000013")  # points at a deleted checkpoint
    path, skipped = find_resume_checkpoint(tmp_path)
    assert path == tmp_path / "step000010" and skipped == [tmp_path / "step000011"]
    # a `latest` at an incomplete checkpoint is not followed either
    (tmp_path / LATEST).unlink()
    (tmp_path / LATEST).symlink_to("step000011")
    assert find_resume_checkpoint(tmp_path)[0] == tmp_path / "step000010"
    # no complete checkpoint at all: a fresh start, not a half-written one
    for s in ("step000001", "step000009", "step000010"):
        (tmp_path / s / METADATA_FILE).unlink()
    assert find_resume_checkpoint(tmp_path)[0] is None


# ---------------------------------------------------------------- processes
def _tool(name: str, *args: str, timeout: float = 120, **env: str):
    return run_checked([sys.executable, f"tools/{name}.py", *map(str, args)], timeout_s=timeout, env=child_env(**env),
                       check=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """tests/dist/checkpoint_run.py on 2 ranks: (work dir, its results)."""
    work = tmp_path_factory.mktemp("ckpt_run")
    return work, run_dist_script("checkpoint_run.py", 2, work, timeout_s=480)


def _tensors(d: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.slow
def test_trainer_checkpoint_on_disk(run_dir):
    work, _ = run_dir
    root = work / "run" / "checkpoints"
    assert os.readlink(root / LATEST) == "step000002"
    assert not (root / ".step000001.partial").exists() and not (root / ".step000002.partial").exists()
    for step in (1, 2):
        actor = read_metadata(root / f"step{step:06d}", role="policy", training=True)
        critic = read_metadata(root / f"step{step:06d}" / "critic", role="critic", training=True)
        for m in (actor, critic):
            assert m["format"] == FORMAT and m["contents"] == ["model", "optimizer"]
            assert m["step"] == m["version"] == m["train_state"]["num_steps"] == step
            assert m["train_state"]["lr_scheduler"]["num_steps"] == step
            assert m["model_type"] == "qwen2" and m["hf_config"]["num_hidden_layers"] == 2
            assert m["saved_layout"].startswith("dp=1 pp=1 cp=1 tp=2") and m["dtype"] == "float32"
            assert m["source_hf_dir"] == str((work / "src").resolve())
        assert actor["extra"] == {"model_path": str(work / "src"), "critic": "critic"}


@pytest.mark.slow
def test_resume_skips_incomplete_and_continues_exactly(run_dir):
    import torch

    _, res = run_dir
    p, ref = res["pp2"], res["tp2"]
    assert p["resumed_from"] == "step000002"  # not step000003 (no metadata), not the staging dir
    assert p["version"] == p["num_steps"] == p["critic_version"] == 2
    diff = lambda a, b: float((torch.tensor(a) - torch.tensor(b)).abs().max())  # noqa: E731
    # TP2 -> PP2: the same weights, every reduction of the 2-layer fp32 forward in another order
    # (tests/support/numerics.py: FWD = 14 of up to K = 200 terms, the vocabulary), relative to the
    # largest value compared; gradients run the chain twice (relative).
    def tol(ref_values):
        return fp32_tol(200, float(torch.tensor(ref_values).abs().max()), ops=transformer_reductions(2))

    lp_t = tol(ref["logprobs"])
    assert diff(res["random_logprobs"], ref["logprobs"]) > lp_t  # the resumed engine started random
    assert diff(p["logprobs"], ref["logprobs"]) <= lp_t
    assert diff(p["values"], ref["values"]) <= tol(ref["values"])
    # the third step: weights + Adam moments + LR schedule restored (warm-up over: full lr, exactly)
    assert p["step3"]["lr"] == ref["step3"]["lr"] == 1e-3 and p["step3"]["step"] == 3
    # its loss is -mean(lp) over the loss tokens: off by at most lp_t, plus the sum's order
    n = int(ref["step3"]["n_tokens"])
    assert abs(p["step3"]["loss"] - ref["step3"]["loss"]) <= lp_t + fp32_tol(n, abs(ref["step3"]["loss"]))
    grad_rel = fp32_tol(200, 1.0, ops=transformer_reductions(2, backward=True))
    assert abs(p["step3"]["grad_norm"] - ref["step3"]["grad_norm"]) <= grad_rel * ref["step3"]["grad_norm"]
    r = res["refusals"]
    assert r["critic_into_actor"].endswith("step000002/critic holds a critic model, not a policy one")
    assert r["actor_into_critic"].endswith("step000002 holds a policy model, not a critic one")
    assert "weights_only holds weights only (no optimizer state)" in r["weights_only"]
    assert "step000003 has no areal_mega.json" in r["incomplete"]


@pytest.mark.slow
def test_trainer_checkpoint_converts_to_the_trainers_own_hf_export(run_dir, tmp_path):
    import torch

    work, _ = run_dir
    out = tmp_path / "hf"
    p = _tool("convert_mcore_to_hf", "--ckpt", work / "run" / "checkpoints" / LATEST, "--out", out, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    got, want, src = _tensors(out), _tensors(work / "run" / "hf"), _tensors(work / "src")
    assert sorted(got) == sorted(want) and "lm_head.weight" in got
    assert [k for k in want if not torch.equal(got[k], want[k])] == []  # bit-exact
    # the control: training moved every tensor, so the source weights would not pass
    assert all(not torch.equal(want[k], src[k]) for k in want)
    assert json.loads((out / "config.json").read_text()) == json.loads((work / "run" / "hf" / "config.json").read_text())
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"marker": "checkpoint_run"}


def _assert_clean_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-4000:]
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.slow
def test_convert_mcore_to_hf_bad_arguments(run_dir, tmp_path):
    work, _ = run_dir
    root = work / "run" / "checkpoints"
    empty = tmp_path / "empty"
    empty.mkdir()
    future = _ckpt(tmp_path / "future", complete=False)
    (future / METADATA_FILE).write_text(json.dumps({**_meta(), "format": "areal_mega.checkpoint.v3"}))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    out = tmp_path / "out"
    cases = [
        (["--ckpt", tmp_path / "missing"], [str(tmp_path / "missing"), "does not exist"]),
        (["--ckpt", empty], [str(empty), "no areal_mega.json"]),
        (["--ckpt", future], [str(future), "areal_mega.checkpoint.v3"]),
        (["--ckpt", root / "step000003"], [str(root / "step000003"), "incomplete"]),  # the crash leftover
        (["--ckpt", root], [str(root), "pass", "latest"]),
        (["--ckpt", root / "step000002" / "critic"], [str(root / "step000002" / "critic"), "critic"]),
        (["--ckpt", root / LATEST, "--pp", "2"], ["world_size(1)", "pp(2)"]),
        (["--ckpt", root / LATEST, "--tokenizer-dir", tmp_path / "missing"], [str(tmp_path / "missing")]),
        (["--ckpt", root / LATEST, "--out", busy], [str(busy), "not an empty directory"]),
        (["--ckpt", root / LATEST, "--peft"], ["--peft", "no LoRA adapters"]),  # a full fine-tune's checkpoint
    ]
    for args, needles in cases:
        if "--out" not in args:
            args = [*args, "--out", out]
        _assert_clean_error(_tool("convert_mcore_to_hf", *args), *needles)
        assert not out.exists()
    # the layout against the model, under a would-be 3-rank world (no process group is formed)
    p = _tool("convert_mcore_to_hf", "--ckpt", root / LATEST, "--out", out, "--pp", "3", WORLD_SIZE="3")
    _assert_clean_error(p, "num_layers(2)", "pp(3)")


@pytest.mark.slow
def test_convert_hf_to_mcore_bad_arguments(run_dir, tmp_path):
    """(The checks both tools share -- world size, --out -- are exercised once, above.)"""
    work, _ = run_dir
    src = work / "src"
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    cases = [
        (["--hf-dir", tmp_path / "missing"], [str(tmp_path / "missing"), "does not exist"]),
        (["--hf-dir", empty], [str(empty), "no config.json"]),
        (["--hf-dir", src, "--tp", "0"], ["tensor_parallel", "must be >= 1"]),
        (["--hf-dir", src, "--dtype", "int3"], ["int3"]),
    ]
    for args, needles in cases:
        if "--out" not in args:
            args = [*args, "--out", out]
        _assert_clean_error(_tool("convert_hf_to_mcore", *args), *needles)
        assert not out.exists()
    p = _tool("convert_hf_to_mcore", "--hf-dir", src, "--out", out, "--tp", "4", WORLD_SIZE="4")
    _assert_clean_error(p, "num_kv_heads(2)", "tp(4)")
