"""Packed batches and token-budget micro-batching: pure tensor logic (torch only, no process
groups), shared by the rollout side (trajectories -> batch) and the learner (micro-batches).
It sits below both so that neither imports the other's room for it."""
