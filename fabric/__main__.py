"""`python -m fabric` is the `semfab` CLI."""

import sys

from fabric.cli import main

# guarded: mpi4py.futures' workers import this module to run sweep points
if __name__ == "__main__":
    sys.exit(main())
