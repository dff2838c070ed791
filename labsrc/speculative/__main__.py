"""``python -m labsrc.speculative``: the command line of :mod:`labsrc.speculative.cli`."""
from labsrc.speculative.cli import main

if __name__ == "__main__":
    main()
