"""``python -m labsrc.distillation ...``: see :mod:`labsrc.distillation.cli`."""
from labsrc.distillation.cli import main

raise SystemExit(main())
