"""`python -m switchd`: one switch daemon (same as `semfab switchd`)."""

import sys

from switchd.cli import main

sys.exit(main())
