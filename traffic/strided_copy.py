"""Rows that lie a fixed pitch apart in host memory, copied to or from contiguous rows on a device.

One layer of consecutive Full Block slots is such a set of rows: each slot's Layer Block, a Full Block apart. On
CUDA from page-locked memory the rows move as one 2-D DMA (``cudaMemcpy2DAsync`` through cupy, on the given
stream), not one copy per row: a 32K-token hit is 512 Layer Blocks per layer, and a copy call each would cost more
host time than the layer's compute (the small-descriptor problem of vLLM #50913). Without cupy, or from pageable
memory, each row is its own copy; host to host is one strided torch copy.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from dualpath.traffic.memory import HostMemory


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slot ids in ``slots``, in order: ``(index in slots, first slot, length)``."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and s == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, s, 1))
    return runs


def copy_rows(
    host: HostMemory,
    offset: int,
    pitch: int,
    rows: torch.Tensor,
    to_host: bool,
    stream: "torch.cuda.Stream | None" = None,
) -> None:
    """Between host rows (``rows.shape[0]`` of ``rows.shape[1]`` bytes, the first at byte ``offset`` of ``host``,
    each ``pitch`` bytes after the last) and ``rows`` (contiguous uint8 ``[n, width]``, host or device). To a
    device the copy is issued on ``stream`` (the current one if None) and does not block the host; to the host it
    has finished on return."""
    n, width = rows.shape
    if offset < 0 or n and offset + (n - 1) * pitch + width > host.nbytes or width > pitch:
        raise ValueError(f"rows of {width} bytes every {pitch} from {offset}: {n} do not fit {host.nbytes} bytes")
    if n == 0:
        return
    strided = host.tensor.as_strided((n, width), (pitch, 1), offset)
    if not rows.is_cuda:
        (strided.copy_(rows) if to_host else rows.copy_(strided))
        return
    stream = stream or torch.cuda.current_stream(rows.device)
    runtime = _cupy_runtime() if host.pinned else None
    if runtime is None:
        _row_by_row(strided, rows, to_host, stream)
        return
    with torch.cuda.device(rows.device):
        if to_host:
            runtime.memcpy2DAsync(
                strided.data_ptr(),
                pitch,
                rows.data_ptr(),
                width,
                width,
                n,
                runtime.memcpyDeviceToHost,
                stream.cuda_stream,
            )
            stream.synchronize()
        else:
            runtime.memcpy2DAsync(
                rows.data_ptr(),
                width,
                strided.data_ptr(),
                pitch,
                width,
                n,
                runtime.memcpyHostToDevice,
                stream.cuda_stream,
            )


def _row_by_row(strided: torch.Tensor, rows: torch.Tensor, to_host: bool, stream: "torch.cuda.Stream") -> None:
    with torch.cuda.stream(stream):
        for i in range(rows.shape[0]):
            if to_host:
                strided[i].copy_(rows[i])
            else:
                rows[i].copy_(strided[i], non_blocking=True)


@functools.lru_cache(maxsize=1)
def _cupy_runtime():
    """cupy's CUDA runtime bindings, or None where cupy or a CUDA device is missing."""
    try:
        import cupy
        from cupy.cuda import runtime
    except ImportError:
        return None
    return runtime if cupy.cuda.is_available() else None
