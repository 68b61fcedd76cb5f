"""megatron-core backend: parallel state wrapper, CPU compatibility, model building, checkpoints.

Import submodules explicitly (``areal_mega.megatron.model`` ...); this package imports nothing
heavy, so that importing one submodule stays cheap.
"""
