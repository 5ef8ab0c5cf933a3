"""`python -m zerotrain ...`: the same as the `zerotrain` command."""

import sys

from zerotrain.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
