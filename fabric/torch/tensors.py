"""Tensors as the NumPy arrays the fabric moves, and torch's reduction ops as the
fabric's.

A contiguous CPU tensor is viewed, not copied: the fabric writes its results
straight into the tensor's memory. NumPy has no bfloat16, so a bf16 tensor is
viewed through ``uint16`` as ml_dtypes' bfloat16 (the registry's type). Data
movement (broadcast, gathers, alltoall, send/recv) carries any dtype by its
bits; reductions take the registry's dtypes only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed import ReduceOp

from fabric.torch.errors import TorchOpError
from kernels.dtypes import BF16, DTYPES

__all__ = ["Staged", "carrier", "check_tensor", "finish", "reduce_op", "stage_in", "stage_out"]


_REDUCIBLE: dict[torch.dtype, np.dtype[Any]] = {
    torch.float32: DTYPES["float32"], torch.float16: DTYPES["float16"],
    torch.bfloat16: BF16, torch.int32: DTYPES["int32"], torch.int64: DTYPES["int64"],
}
# a dtype outside the registry travels as the registry dtype of its width
_CARRIERS: dict[int, np.dtype[Any]] = {8: DTYPES["int64"], 4: DTYPES["int32"],
                                       2: DTYPES["float16"]}
# ReduceOp.SUM and friends are the RedOpType values ``opts.reduceOp.op`` holds
_OPS: dict[Any, str] = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
                        ReduceOp.AVG: "sum"}


def reduce_op(op: Any, dtype: torch.dtype, rank: int, what: str) -> tuple[str, bool]:
    """(fabric op name, divide by the group size after) of torch's ``op``."""
    kind = getattr(op, "op", op)
    if kind not in _OPS:
        raise TorchOpError(rank, what, f"reduce op {kind} is not supported; use SUM, AVG, "
                           "MAX or MIN")
    if dtype not in _REDUCIBLE:
        raise TorchOpError(rank, what, f"dtype {dtype} cannot be reduced on the fabric; use "
                           "one of float32, float16, bfloat16, int32, int64")
    avg = kind == ReduceOp.AVG
    if avg and not dtype.is_floating_point:
        raise TorchOpError(rank, what, f"AVG needs a floating-point tensor, not {dtype}")
    return _OPS[kind], avg


def check_tensor(t: Any, rank: int, what: str) -> torch.Tensor:
    """``t`` if it is a CPU tensor; a typed refusal otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TorchOpError(rank, what, f"expected a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TorchOpError(rank, what, f"tensor on device {t.device}: the semfab backend "
                           "takes CPU tensors (move it with .cpu(), or give this device "
                           "another backend: init_process_group('cpu:semfab,cuda:nccl'))")
    if t.is_sparse or t.is_quantized or t.is_complex():
        raise TorchOpError(rank, what, f"{t.layout} / {t.dtype} tensors are not supported")
    return t


def carrier(dtype: torch.dtype, reduce: bool, rank: int, what: str) -> np.dtype[Any] | None:
    """The NumPy dtype a ``dtype`` tensor travels as (None: widened to int32 and
    back, for 1-byte types outside reductions)."""
    if dtype in _REDUCIBLE:
        return _REDUCIBLE[dtype]
    if reduce:
        reduce_op(ReduceOp.SUM, dtype, rank, what)  # raises the typed refusal
    size = torch.empty((), dtype=dtype).element_size()
    if size in _CARRIERS:
        return _CARRIERS[size]
    if size == 1:
        return None
    raise TorchOpError(rank, what, f"dtype {dtype} is not supported")


@dataclass
class Staged:
    """A tensor's data as a 1-D array; ``copy_back`` when the array is not the
    tensor's own memory."""

    tensor: torch.Tensor
    array: np.ndarray
    copy_back: bool


def _view(t: torch.Tensor, dt: np.dtype[Any]) -> np.ndarray:
    flat = t.detach().reshape(-1)
    if t.dtype == torch.bfloat16:
        return flat.view(torch.uint16).numpy().view(BF16)
    if t.dtype in _REDUCIBLE:
        return flat.numpy()
    # same width, another registry type: reinterpret the bits
    return flat.view({8: torch.int64, 4: torch.int32, 2: torch.float16}[dt.itemsize]).numpy()


def stage_in(t: torch.Tensor, reduce: bool, rank: int, what: str, *,
             copy: bool = False) -> Staged:
    """``t`` as a 1-D array sharing its memory where it can (``copy``: always a copy,
    e.g. an input that aliases its own output)."""
    dt = carrier(t.dtype, reduce, rank, what)
    if dt is None:
        return Staged(t, t.detach().reshape(-1).to(torch.int32).numpy(), True)
    if not t.is_contiguous():
        return Staged(t, _view(t.contiguous(), dt), True)
    arr = _view(t, dt)
    return Staged(t, arr.copy() if copy else arr, copy)


def stage_out(t: torch.Tensor, rank: int, what: str, reduce: bool = False) -> Staged:
    """Where the fabric writes ``t``'s new contents: its own memory when contiguous."""
    dt = carrier(t.dtype, reduce, rank, what)
    if dt is None:
        return Staged(t, np.empty(t.numel(), np.int32), True)
    if not t.is_contiguous():
        return Staged(t, np.empty(t.numel(), dt), True)
    return Staged(t, _view(t, dt), False)


def finish(s: Staged) -> None:
    """Copy a staged result back into its tensor (no-op for views)."""
    if not s.copy_back:
        return
    t = s.tensor
    src = torch.from_numpy(s.array.view(np.uint16) if s.array.dtype == BF16 else s.array)
    if src.dtype != t.dtype:
        if t.element_size() == 1 or t.dtype == torch.bool:
            src = src.to(t.dtype)  # widened 1-byte values
        else:
            src = src.view(t.dtype)
    with torch.no_grad():
        t.detach().copy_(src.reshape(t.shape))
