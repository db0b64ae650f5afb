"""`python -m specd_cli`: the `specd` command (how `specd serve` starts its workers)."""
import sys

from specd_cli.commands import main

sys.exit(main())
