"""``python -m bench``: the performance suite (see ``bench.run``)."""

import sys

from bench.run import main

sys.exit(main())
