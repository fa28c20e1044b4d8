"""`python -m autotune ...`: the same command line as `autotune ...`, for environments
where the console script is not on PATH (and for scripts that want this interpreter)."""

import sys

from autotune.cli import main

sys.exit(main())
