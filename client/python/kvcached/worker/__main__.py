"""`python -m kvcached.worker`: see cli.py."""

import sys

from .cli import main

sys.exit(main())
