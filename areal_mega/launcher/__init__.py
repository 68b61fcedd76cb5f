"""Placement and process supervision for learners (torchrun) and inference engines.

Entry point: ``python -m areal_mega.launcher {slurm,local} --config X [--dry-run] [overrides]``.
``cli.load_launch`` builds the typed experiment once, ``plan.build_plan`` is the pure placement
(testable without a cluster; the per-GPU estimator is ``simulator.memory``),
``supervisor.supervise`` the run loop shared by ``slurm.SrunRunner`` and ``local.LocalRunner``;
``engine_proc`` wraps each inference server to announce its address.
"""
