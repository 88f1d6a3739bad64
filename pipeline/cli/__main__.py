"""`python -m pipeline.cli VERB ...` (what tests, launchers and the demo start) is `prism VERB ...`."""

import sys

from pipeline.cli import main

sys.exit(main())
