"""``python -m flowrl``: the command line."""

from flowrl.cli import main

raise SystemExit(main())
