"""`python -m specd.cli`: the `specd` command (how `specd serve` starts its workers)."""
import sys

from specd.cli.commands import main

sys.exit(main())
