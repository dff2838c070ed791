"""``python -m labsrc.memory``: the command line of :mod:`labsrc.memory.stored`."""
from labsrc.memory.stored import main

if __name__ == "__main__":
    main()
