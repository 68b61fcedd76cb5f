"""Throughput planner: a discrete-event simulator of the asynchronous RL pipeline (pure Python).

* ``model``: the inputs (SimConfig and its length, decode, learner and weight-sync models)
* ``sim``: ``simulate(cfg) -> SimResult`` driving the real admission rule
  (``rollout.staleness.StalenessManager``) and batch-formation rule (``can_form_batch``)
* ``calibrate``: cost models fitted to a real run's ``metrics.jsonl`` (tools/bench_simulator.py)
* ``costs``: GPU cost models from published figures (ClusterCostModel, WorkloadModel)
* ``memory``: the per-GPU memory estimate (the launcher's verdict, docs/launch.md)
* ``planner``: the sweep behind ``areal-mega plan`` (command line in launcher/cli.py): the
  inference/learner split and max_staleness within that memory plan
* ``plot``: the PNG of predicted throughput (optional: needs matplotlib)

No torch, no numpy: it runs wherever the launcher's dry run does. Design notes: docs/simulator.md.
"""

from areal_mega.simulator.model import (  # noqa: F401
    DecodeModel, HostModel, LearnerModel, LengthModel, SimConfig, SimulationError, SyncModel,
)
from areal_mega.simulator.sim import SimResult, simulate  # noqa: F401
