"""Placement and process supervision for learners (torchrun) and inference engines.

Entry point: ``python -m areal_mega.launcher {slurm,local} --config X [--dry-run] [overrides]``.
``plan.build_plan`` is the pure placement (testable without a cluster), ``memory`` the per-GPU
estimator, ``supervisor.supervise`` the run loop shared by ``slurm.SrunRunner`` and
``local.LocalRunner``; ``engine_proc`` wraps each inference server to announce its address.
"""
