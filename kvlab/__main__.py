"""`python -m kvlab ...`: the command line, as `torchrun -m kvlab` launches it on every rank."""

import sys

from kvlab.cli import main

sys.exit(main())
