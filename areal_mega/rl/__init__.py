"""The RL algorithm layer and the rollout side of asynchronous RL.

* ``config``: AlgorithmConfig, RolloutConfig
* ``advantages``: GRPO / Dr.GRPO / RLOO / REINFORCE++ / GAE over packed batches
* ``losses``: (decoupled) PPO policy loss, value loss, KL estimators, aggregation
* ``staleness``: StalenessManager (the bounded-staleness admission rule)
* ``controller``: RolloutController (async rollouts feeding the trainer)
* ``batch``: trajectories -> packed batch dict

Submodules are imported explicitly (``from areal_mega.rl.losses import ...``) so that importing
one does not pull in the others' dependencies.
"""
