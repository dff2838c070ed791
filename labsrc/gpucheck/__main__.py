import sys

from labsrc.gpucheck import main

sys.exit(main())
