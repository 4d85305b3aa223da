"""Point-to-point bulk WRITE streams between two workers, through the switch.

The streams are pure programs (:class:`fabric.core.programs.StreamSend` and
:class:`~fabric.core.programs.StreamRecv`, over the Sender/Receiver state machines
of :mod:`fabric.core.reliability`): frames are WRITEs carrying a slice of the
source buffer at its byte offset; the receiver stores each slice at that
offset on first arrival (unordered delivery, as RDMA WRITEs to distinct
addresses) and answers with ACK (cumulative PSN + SACK bitmap) and gap NACKs.
The retransmit policy (``selective`` or ``gbn``, or any registered one) is
chosen by name. This module runs them on an emulated endpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fabric.core.programs import (
    P2P_FLOW,
    STREAM_MAX_RETRIES,
    STREAM_RTO_MAX_S,
    STREAM_WINDOW,
    StreamRecv,
    StreamSend,
)

if TYPE_CHECKING:
    from fabric.emulation.endpoint import Endpoint

__all__ = ["P2P_FLOW", "STREAM_MAX_RETRIES", "STREAM_RTO_MAX_S", "STREAM_WINDOW",
           "stream_recv", "stream_send"]


def stream_send(ep: Endpoint, dst_rank: int, data: np.ndarray, *, policy: str = "selective",
                frame_bytes: int | None = None, flow: int = P2P_FLOW,
                window_frames: int = STREAM_WINDOW) -> dict[str, Any]:
    """Send ``data``'s bytes reliably to worker ``dst_rank``; returns sender statistics
    plus ``seconds`` (first send to last ACK)."""
    del flow  # one flow pair for every stream: ids and directions keep them apart
    prog = StreamSend(ep.state, dst_rank, data, policy=policy, frame_bytes=frame_bytes,
                      window_frames=window_frames)
    result: dict[str, Any] = ep.run(prog, f"WRITE stream to rank {dst_rank}")
    return result


def stream_recv(ep: Endpoint, src_rank: int, out: np.ndarray, *, policy: str = "selective",
                frame_bytes: int | None = None, flow: int = P2P_FLOW,
                window_frames: int = STREAM_WINDOW) -> dict[str, Any]:
    """Receive a stream from worker ``src_rank`` into ``out``; returns receiver statistics."""
    from dataclasses import asdict

    del flow
    prog = StreamRecv(ep.state, src_rank, out, policy=policy, frame_bytes=frame_bytes,
                      window_frames=window_frames)
    ep.run(prog, f"WRITE stream from rank {src_rank}")
    return asdict(prog.receiver.statistics())
