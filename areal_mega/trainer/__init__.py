"""Trainer assembly: the experiment config, the :class:`~areal_mega.trainer.trainer.Trainer` that
owns the engines, weight sync and the rollout service, the one-screen loop, and the PPO critic.

* ``config``: ExperimentConfig, the one YAML of a run, and ``load_experiment``
* ``trainer``: Trainer (built once per learner rank; everything the loop calls)
* ``loop``: ``run_train``, the training loop
* ``critic``: CriticEngine (PPO value model)
"""
