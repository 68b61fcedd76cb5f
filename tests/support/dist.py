"""Pieces every torchrun check script in tests/dist/ shares: the HF reference computation and the
end of a run (rank 0 writes the results the pytest side reads; everybody leaves together)."""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist


def hf_reference(hf_dir: str, batch: dict, temperature: float) -> tuple[list[float], list[float]]:
    """Each packed sequence ALONE through HF transformers (fp32): next-token log-softmax(logits / T)
    of the token that follows, and the entropy of that distribution, flattened in packing order
    (the last position of each sequence has no next token: 0 for both)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    cu = batch["cu_seqlens"].tolist()
    lp_all, ent_all = [], []
    with torch.no_grad():
        for i in range(len(cu) - 1):
            ids = batch["input_ids"][cu[i]: cu[i + 1]]
            logp = torch.log_softmax(model(ids[None]).logits[0].float() / temperature, -1)
            lp = torch.zeros(len(ids))
            lp[:-1] = logp[:-1].gather(-1, ids[1:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
            ent[-1] = 0.0
            lp_all += lp.tolist()
            ent_all += ent.tolist()
    return lp_all, ent_all


def start_layouts_run() -> tuple[Path, str, int, dict]:
    """The start of a tests/dist/*_layouts.py run: ``--work-dir W --out R.pt`` parsed, the gloo
    world joined; returns (W, R.pt, world size, W/ref.pt: the HF reference the pytest side wrote)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work_dir)
    dist.init_process_group("gloo")
    return work, args.out, dist.get_world_size(), torch.load(work / "ref.pt")


def export_check(model, groups, hf_file) -> tuple[tuple | None, list]:
    """This rank's check of the weight-sync export (``export_hf_weights``, what every transport
    sends) against the HF checkpoint ``hf_file`` (an HFCheckpointReader or an adapter's view of it):
    (row, stream). On an exporting rank row = (pp rank, is the stage's sender, #tensors bit-identical
    to the file, #differing, names in export order) and stream = the (name, tensor) pairs it sent;
    elsewhere (None, [])."""
    from areal_mega.megatron.model import export_hf_weights

    if not groups.layout.exports(groups.rank):
        return None, []
    c = groups.coords
    same, diff, names, stream = 0, 0, [], []
    for n, t in export_hf_weights(model):
        names.append(n)
        if t is None:  # EP: only the stage's sender holds every expert
            continue
        stream.append((n, t))
        same, diff = (same + 1, diff) if torch.equal(t, hf_file.read(n)) else (same, diff + 1)
    return (c.pp, c.tp == 0 and c.dp == 0 and c.ep == 0, same, diff, names), stream


def convert_round_trip(hf_dir: Path, out: Path, to_mcore: list[str], to_hf: list[str]) -> None:
    """HF ``hf_dir`` -> megatron checkpoint ``<out>_ckpt`` (layout flags ``to_mcore``) -> HF
    ``<out>_hf`` (flags ``to_hf``) through the conversion tools' own main(), on every rank."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import convert_hf_to_mcore
    import convert_mcore_to_hf

    assert convert_hf_to_mcore.main(["--hf-dir", str(hf_dir), "--out", f"{out}_ckpt", *to_mcore]) == 0
    assert convert_mcore_to_hf.main(["--ckpt", f"{out}_ckpt", "--out", f"{out}_hf", *to_hf]) == 0


def finish(results: dict, out: str) -> None:
    """Rank 0 writes ``results`` to ``out`` (a torch file if it ends in .pt, else JSON); then every
    rank leaves the process group (the barrier keeps a rank from tearing gloo down while rank 0
    still writes)."""
    if dist.get_rank() == 0:
        if str(out).endswith(".pt"):
            torch.save(results, out)
        else:
            with open(out, "w") as f:
                json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def gather(obj):
    """Every rank's ``obj`` (a picklable value), in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def last_stage_value(out):
    """The value the last pipeline stage holds (other ranks pass None), on every rank."""
    return [o for o in gather(out) if o is not None][0]



@contextmanager
def servers_paused(servers, mode: str = "retract"):
    """Generation paused on ``servers`` (SGLangClients; rank 0 sends) for the block and continued
    after it, also when it raises: what the trainer's rollout service does around a weight sync
    (a sync never pauses by itself)."""
    from areal_mega.inference import sglang_api as api

    if dist.get_rank() == 0:
        for s in servers:
            s.send(api.pause_generation(mode))
    try:
        yield
    finally:
        if dist.get_rank() == 0:
            for s in servers:
                s.send(api.continue_generation())


def megatron_world_released():
    """Body of a module-scoped fixture (``yield from megatron_world_released()``): a test module
    that sets up megatron's world of one in the pytest process tears it down after its tests
    (later modules expect no default process group), unless one existed before it."""
    from megatron.core import parallel_state as ps

    had_group = dist.is_initialized()
    yield
    if not had_group:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def megatron_world_of_one():
    """This pytest process's gloo world of one with megatron's TP1 groups (whatever an earlier test
    left torn down first); pair it with a module fixture running megatron_world_released."""
    from megatron.core import parallel_state as ps

    from areal_mega.megatron import cpu_compat
    from areal_mega.megatron.parallel_state import init_model_parallel, init_process_group_for_script
    from areal_mega.parallel import ParallelLayout

    cpu_compat.apply()
    init_process_group_for_script()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if ps._GLOBAL_MEMORY_BUFFER is not None:  # set alone by an earlier test (test_core_attention)
        ps.destroy_global_memory_buffer()
    return init_model_parallel(ParallelLayout(world_size=1), backend="gloo")


def run_layouts_script(script: str, work: Path, timeout_s: int) -> dict:
    """``script`` (a tests/dist/*_layouts.py) on 2 gloo ranks over ``work`` (its W/ref.pt written by
    the caller); the results its rank 0 wrote."""
    from tests.support.launch import child_env, run_checked, torchrun_cmd

    run_checked(torchrun_cmd(2, script, "--work-dir", work, "--out", work / "results.pt"), timeout_s=timeout_s,
                env=child_env(PYTHONWARNINGS="ignore"), merge_stderr=True)
    return torch.load(work / "results.pt")
