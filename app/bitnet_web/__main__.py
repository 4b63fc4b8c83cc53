"""`python -m bitnet_web`: the command line (cli.py)."""

from .cli import main

raise SystemExit(main())
