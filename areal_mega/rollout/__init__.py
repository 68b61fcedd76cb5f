"""The rollout side of asynchronous RL: what decides which episodes run and which batch trains.

* ``config``: RolloutConfig (``rollout.*``)
* ``staleness``: StalenessManager, the bounded-staleness admission rule
* ``controller``: RolloutController, episodes in flight feeding finished batches
* ``driver``: RolloutDriver, the inference pool + controller on a background event loop (rank 0)
* ``batch``: trajectories -> packed batch dict, broadcast to every learner rank

Submodules are imported explicitly (``from areal_mega.rollout.staleness import ...``).
"""
