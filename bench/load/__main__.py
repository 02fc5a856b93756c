"""``python -m bench.load``: see run.py."""

import sys

from bench.load.run import main

sys.exit(main())
