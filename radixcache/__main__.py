"""``python -m radixcache``: the ``radixcache`` command."""

import sys

from .cli import main

sys.exit(main())
