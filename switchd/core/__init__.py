"""The switch's pure core: a forwarding core and its in-network services.

:class:`SwitchCore` (:mod:`switchd.core.switch`) is what a driver runs; each
service is one module (aggregation, jobs, multicast, combine, barriers,
regions, tenants), and new ones subclass :class:`Service`. Sans-IO: no
sockets, no clock, no driver imports (tests/test_purity.py).
"""

from switchd.core.combine import COMBINE_FLOW
from switchd.core.context import Output, SwitchContext
from switchd.core.jobs import JOB_TRANSITIONS, JobPhase
from switchd.core.regions import DOORBELL_SUFFIX, MemoryPlane
from switchd.core.service import Service
from switchd.core.switch import SwitchCore, SwitchStats

__all__ = ["COMBINE_FLOW", "DOORBELL_SUFFIX", "JOB_TRANSITIONS", "JobPhase", "MemoryPlane",
           "Output", "Service", "SwitchContext", "SwitchCore", "SwitchStats"]
