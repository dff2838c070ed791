"""``python -m labsrc.bench``: see :mod:`labsrc.bench`."""
from labsrc.bench import main

raise SystemExit(main())
