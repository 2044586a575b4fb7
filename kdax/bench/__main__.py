"""``python -m kdax.bench``."""

import sys

from ._main import main

sys.exit(main())
