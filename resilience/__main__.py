"""``python -m resilience ...``: the same as the ``resilience`` console script."""

import sys

from resilience.cli import main

if __name__ == "__main__":
    sys.exit(main())
