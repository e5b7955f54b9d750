"""``python -m bigmem_train.cli``: the same as the ``bigmem-train`` command."""

import sys

from bigmem_train.cli import main

sys.exit(main())
