"""`python -m nvrx.supervisor`: the same program as `nvrx-supervise`."""

import sys

from .cli import main

sys.exit(main())
