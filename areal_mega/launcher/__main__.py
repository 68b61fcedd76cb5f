"""``python -m areal_mega.launcher {slurm,local} --config X [--dry-run] [overrides]`` (see cli.py)."""

import sys

from areal_mega.launcher.cli import main

sys.exit(main())
