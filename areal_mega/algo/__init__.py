"""RL algorithm maths, free of engines and servers: advantages and losses over packed batches.

* ``config``: AlgorithmConfig (``algorithm.*``)
* ``advantages``: GRPO / Dr.GRPO / RLOO / REINFORCE++ / GAE
* ``losses``: (decoupled) PPO policy loss, value loss, KL estimators, aggregation

Submodules are imported explicitly (``from areal_mega.algo.losses import ...``).
"""
