"""Simulation: the protocol core driven by a discrete-event loop in virtual time.

See :mod:`fabric.sim.engine`. The same :class:`switchd.core.SwitchCore`,
:class:`fabric.core.link.LinkPipeline` and :mod:`fabric.core.programs` that emulation
runs, at scales no machine can emulate.
"""

from fabric.sim.engine import SimResult, Simulation, SimulationError, TimingModel

__all__ = ["SimResult", "Simulation", "SimulationError", "TimingModel"]
