"""Test-wide settings.

Numba's CUDA simulator must be chosen before numba is first imported, so the
numba-cuda kernels run (slowly, on the CPU) on machines without a GPU.
"""

import os
import signal

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

# A suite started in the background of a script inherits SIGINT ignored (shells
# without job control do that), and so would every process it starts: the tests
# that press Ctrl-C on a launcher would wait in vain. Take SIGINT back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
