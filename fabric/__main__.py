"""`python -m fabric` is the `semfab` CLI."""

import sys

from fabric.cli import main

sys.exit(main())
