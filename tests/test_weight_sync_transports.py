"""The transports' shared frame without SGLang or megatron (world of one, gloo; in-process fake
servers, areal_mega/inference/fake_server.py): the factory's one choice per mode, a whole disk sync
(what the servers are asked, what lands on disk), targets, and the check's failure before
anything is sent. ~2 s. Broadcast and reshard against real servers: test_weight_sync_sglang.py,
test_weight_sync_reshard_sglang.py; broadcast into stand-in receivers: test_tools.py."""

from __future__ import annotations

import json
import typing

import pytest
import torch
import torch.distributed as dist

from areal_mega.inference.sglang_api import SGLangClient
from areal_mega.models import get_adapter
from areal_mega.parallel import ParallelLayout
from areal_mega.utils.procs import free_port
from areal_mega.weight_sync import (BroadcastSync, DiskSync, LearnerSide, ReshardSync, WeightSync, WeightSyncConfig,
                                    WeightSyncError, plan_weight_sync)
from areal_mega.weight_sync.sync import TRANSPORTS
from tests.support.models import tiny_config
from tests.test_rollout_driver import Fakes

pytestmark = pytest.mark.timeout(60)

HF = dict(tiny_config("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=2, num_hidden_layers=2), torch_dtype="bfloat16")


class Recording(SGLangClient):
    """A client that records every call it sends (path, body)."""

    def __init__(self, url: str, log: list) -> None:
        super().__init__(url, timeout_s=10)
        self.log = log

    def send(self, call):
        self.log.append((self.url, call.path, call.body))
        return super().send(call)


@pytest.fixture
def world():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    f = Fakes(2)
    try:
        yield f
    finally:
        f.close()
        dist.destroy_process_group()


def _learner(bucket_bytes: int, expected_fn=None) -> tuple[LearnerSide, dict[str, torch.Tensor]]:
    layout = ParallelLayout(world_size=1)
    stage = get_adapter(HF).plan(layout, dtype="bfloat16")[0]
    g = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in stage.tensors}
    plan = plan_weight_sync([stage.tensors], layout, bucket_bytes)
    return LearnerSide(layout=layout, rank=0, group=dist.group.WORLD, plan=plan, export=lambda: iter(weights.items()),
                       expected_fn=expected_fn, hf_config=HF), weights


def test_one_transport_per_mode_and_a_mismatched_class_refused():
    """The factory's table covers every mode the config accepts, each class implementing its own."""
    modes = typing.get_args(typing.get_type_hints(WeightSyncConfig)["mode"])
    assert set(TRANSPORTS) == set(modes) == {"broadcast", "reshard", "disk"}
    assert TRANSPORTS == {"broadcast": BroadcastSync, "reshard": ReshardSync, "disk": DiskSync}
    assert all(issubclass(c, WeightSync) and c.mode == m for m, c in TRANSPORTS.items())


def test_disk_sync_end_to_end_never_pauses(world, tmp_path):
    """One disk sync: every server is asked exactly one /update_weights_from_disk (no pause, no
    continue, no update session: pausing is the caller's), with the cache flush the pause mode
    allows; the files are a sharded HF checkpoint holding exactly the exported tensors."""
    from safetensors.torch import load_file

    urls = [f"http://127.0.0.1:{p}" for p in world.ports]
    for pause_mode, flush in (("retract", True), ("in_place", False)):
        log: list = []
        learner, weights = _learner(bucket_bytes=20_000)
        cfg = WeightSyncConfig(mode="disk", disk_dir=str(tmp_path / pause_mode), check_model=False)
        ws = TRANSPORTS[cfg.mode](cfg, learner, servers=[Recording(u, log) for u in urls], pause_mode=pause_mode)
        assert type(ws) is DiskSync
        stats = ws.sync(3)
        assert stats.mode == "disk" and stats.version == 3
        assert stats.bytes == learner.plan.nbytes == sum(t.numel() * 2 for t in weights.values())
        assert stats.num_buckets == learner.plan.num_buckets > 2  # several files, one per bucket
        out = tmp_path / pause_mode / "v3"
        assert sorted((u, p) for u, p, _ in log) == sorted((u, "/update_weights_from_disk") for u in urls)
        assert all(b == {"model_path": str(out), "flush_cache": flush, "weight_version": "3"} for _, _, b in log)
        assert [fk.weight_version for fk in world.fakes] == ["3", "3"] and not any(fk.paused for fk in world.fakes)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(weights) and index["metadata"]["total_size"] == stats.bytes
        got = {}
        for name in set(index["weight_map"].values()):
            got.update(load_file(str(out / name)))
        assert set(got) == set(weights) and all(torch.equal(got[n], w) for n, w in weights.items())
        assert json.loads((out / "config.json").read_text()) == HF
        ws.close()


def test_targets_keep_their_clients(world, tmp_path):
    """set_targets keeps the client of a server it already knows and makes one for a new URL;
    the same list again changes nothing."""
    urls = [f"http://127.0.0.1:{p}" for p in world.ports]
    learner, _ = _learner(bucket_bytes=1 << 20)
    ws = DiskSync(WeightSyncConfig(mode="disk", disk_dir=str(tmp_path), check_model=False), learner,
                  servers=[SGLangClient(urls[0])])
    first = ws.servers[0]
    ws.set_targets(urls[:1])
    assert ws.servers[0] is first
    ws.set_targets(urls)
    assert ws.server_urls == urls and ws.servers[0] is first and ws.servers[1] is not first
    ws.sync(1)
    assert [fk.weight_version for fk in world.fakes] == ["1", "1"]


def test_check_failure_is_raised_before_anything_is_sent(world, tmp_path):
    """check_model: the fake servers' model_path has no config.json, so the check fails -- on every
    rank, as WeightSyncError naming the way out -- and no update call was made (the control: the
    same learner without the check syncs)."""
    urls = [f"http://127.0.0.1:{p}" for p in world.ports]
    log: list = []
    learner, _ = _learner(bucket_bytes=1 << 20, expected_fn=lambda hf: [])
    cfg = WeightSyncConfig(mode="disk", disk_dir=str(tmp_path))
    ws = DiskSync(cfg, learner, servers=[Recording(u, log) for u in urls])
    with pytest.raises(WeightSyncError, match="no config.json readable.*check_model=false"):
        ws.sync(1)
    assert {p for _, p, _ in log} == {"/model_info"} and not (tmp_path / "v1").exists()
    cfg.check_model = False
    ws.sync(1)
    assert "/update_weights_from_disk" in {p for _, p, _ in log}


def test_constructor_errors_are_one_line():
    learner = LearnerSide(layout=ParallelLayout(world_size=1), rank=0, group=None, plan=None, export=list)
    with pytest.raises(ValueError, match=r"mode: 'disk' is configured, BroadcastSync is the 'broadcast' transport"):
        BroadcastSync(WeightSyncConfig(mode="disk", disk_dir="d", check_model=False), learner)
    with pytest.raises(ValueError, match="mode: reshard needs the learner's adapter"):
        ReshardSync(WeightSyncConfig(mode="reshard", check_model=False), learner)
    with pytest.raises(ValueError, match="pause_mode: 'stop' is not one of"):
        DiskSync(WeightSyncConfig(mode="disk", disk_dir="d", check_model=False), learner, pause_mode="stop")
    with pytest.raises(ValueError, match="check_model: needs expected_fn"):
        DiskSync(WeightSyncConfig(mode="disk", disk_dir="d"), learner)
