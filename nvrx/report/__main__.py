"""`python -m nvrx.report`: the same program as `nvrx-report`."""

import sys

from .cli import main

sys.exit(main())
