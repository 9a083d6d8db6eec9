"""`python -m fxpipe` runs the fxpipe command."""

import sys

from fxpipe.cli import main

sys.exit(main())
