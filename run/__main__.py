"""`python -m qwen3_spmd.run` is `qwen3-spmd`."""

import sys

from qwen3_spmd.run.cli import main

sys.exit(main())
