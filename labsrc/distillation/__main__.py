"""``python -m labsrc.distill ...``: see :mod:`labsrc.distill.cli`."""
from labsrc.distill.cli import main

raise SystemExit(main())
