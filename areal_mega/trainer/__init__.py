"""Trainer assembly: the :class:`~areal_mega.trainer.trainer.Trainer` that
owns the engines, weight sync and the rollout service, the one-screen loop, and the PPO critic.

* ``config``: TrainerLoopConfig, the ``trainer:`` section (the whole YAML of a run is
  ``areal_mega.experiment.ExperimentConfig``)
* ``trainer``: Trainer (built once per learner rank; everything the loop calls)
* ``main``: the composition root (``build``: every component by one call; ``main``: the entry)
* ``loop``: ``run``, the training loop
* ``critic``: CriticEngine (PPO value model)
"""
