"""`python -m run` is `qwen3-spmd`."""

import sys

from run.cli import main

sys.exit(main())
