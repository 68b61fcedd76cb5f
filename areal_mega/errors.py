"""The error users get for bad input: one line naming the key, the file or the path at fault.

Command-line entry points catch :class:`UserError` and print its message alone (exit 2); any
other exception is a bug and keeps its traceback.
"""

__all__ = ["UserError"]


class UserError(ValueError):
    """Bad input (a config key, a YAML file, a checkpoint path): the message is the whole story."""


EXIT_REFUSED = 2
"""Exit code of every refusal before anything started -- bad input, a layout, split or memory
plan that cannot run, a failed pre-flight check -- from every command-line entry point (the
launcher, its dry run, ``areal-mega``); 1 means a run that had started failed (docs/launch.md)."""
