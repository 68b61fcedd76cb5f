"""The rollout side of asynchronous RL: what decides which episodes run and which batch trains.

* ``config``: RolloutConfig (``rollout.*``)
* ``staleness``: StalenessManager, the bounded-staleness admission rule
* ``controller``: RolloutController, episodes in flight feeding finished batches
* ``service``: RolloutService, the generation side behind next_batch / begin_update / end_update (rank 0)
* ``batch``: trajectories -> packed batch dict, broadcast to every learner rank

Submodules are imported explicitly (``from areal_mega.rollout.staleness import ...``).
"""
