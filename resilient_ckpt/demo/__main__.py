"""`python -m resilient_ckpt.demo [--elastic] ...`: runs `cli.main` and exits with its code."""
import sys

from .cli import main

sys.exit(main())
