"""python -m engine: the CLI (engine/frontends/cli.py)."""
import sys

from engine.frontends.cli import main

sys.exit(main())
