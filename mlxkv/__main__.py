"""``python -m mlxkv``: the ``mlxkv`` command."""

import sys

from .cli import main

sys.exit(main())
