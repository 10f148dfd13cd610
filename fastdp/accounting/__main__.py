"""``python -m fastdp.accounting``: see :mod:`fastdp.accounting.cli`."""

import sys

from fastdp.accounting.cli import main

sys.exit(main())
