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


import pytest  # noqa: E402  (after the environment settings above)


@pytest.fixture(scope="session")
def assets_dir(tmp_path_factory: pytest.TempPathFactory):
    """The serving chain's tokenizer and token map, trained once into a fresh cache."""
    from fabric.serving import assets

    return assets.ensure_assets(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tokenizer(assets_dir):
    """The tokenizer of :func:`assets_dir`."""
    from fabric.serving import assets

    return assets.load_tokenizer(assets_dir)
