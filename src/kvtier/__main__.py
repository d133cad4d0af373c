"""``python -m kvtier``: the same entry point as the ``kvtier`` console script."""

from kvtier.cli import main

raise SystemExit(main())
