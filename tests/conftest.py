"""Test-wide settings.

Numba's CUDA simulator must be chosen before numba is first imported, so the
numba-cuda kernels run (slowly, on the CPU) on machines without a GPU.
"""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
