"""``python -m dualpath.cli``: the ``dualpath`` command."""

import sys

from dualpath.cli import main

sys.exit(main())
