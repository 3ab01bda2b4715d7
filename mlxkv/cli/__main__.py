"""``python -m mlxkv.cli``: the ``mlxkv`` command."""

import sys

from . import main

sys.exit(main())
