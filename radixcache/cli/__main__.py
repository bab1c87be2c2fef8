"""``python -m radixcache.cli``: the ``radixcache`` command (as ``python -m radixcache``)."""

import sys

from . import entry_point

sys.exit(entry_point())
