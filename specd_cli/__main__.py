"""`python -m specd_cli`: the `specd` command (how `specd serve` starts its workers)."""
import sys

from specd_cli.parser import main

sys.exit(main())
