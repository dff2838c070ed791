"""``python -m labsrc.weight_quant``: the command line of :mod:`labsrc.weight_quant.experiment`."""
from labsrc.weight_quant.experiment import main

if __name__ == "__main__":
    main()
