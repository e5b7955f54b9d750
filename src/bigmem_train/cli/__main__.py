"""``python -m bigmem_train.cli``: the same as the ``bigmem-train`` command."""

import sys

from . import main

sys.exit(main())
