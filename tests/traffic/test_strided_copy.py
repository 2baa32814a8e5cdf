"""One layer of buffer slots to and from a device: runs of consecutive slots found on plain data, each run moved
as one strided copy (a 2-D DMA on CUDA from pinned memory), byte for byte what a copy per Layer Block gives.
The CUDA cases run on the GPU machine (bench/gpu/run.sh)."""

import pytest
import torch
from hypothesis import given, strategies as st

from dualpath.core.geometry import KVGeometry
from dualpath.traffic.buffer import BufferPool
from dualpath.traffic.memory import HostMemory
from dualpath.traffic.strided_copy import copy_rows, slot_runs

GEOM = KVGeometry(num_layers=3, block_size=4, kv_elems_per_token=6, dtype="bfloat16")  # 48 B per Layer Block
SLOTS = [5, 6, 7, 2, 3, 9, 0]  # three runs, a single, and a backwards step
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@given(st.lists(st.integers(0, 30), max_size=20))
def test_runs_cover_the_slots_in_order_and_are_maximal(slots):
    runs = slot_runs(slots)
    assert [s for _, first, n in runs for s in range(first, first + n)] == slots
    assert [i for i, _, _ in runs] == [sum(n for _, _, n in runs[:k]) for k in range(len(runs))]
    assert all(a[1] + a[2] != b[1] for a, b in zip(runs, runs[1:]))  # no run continues the one before it


def test_slot_runs_examples():
    assert slot_runs(SLOTS) == [(0, 5, 3), (3, 2, 2), (5, 9, 1), (6, 0, 1)]
    assert slot_runs([]) == []


def pool(pin=False):
    p = BufferPool(GEOM, 10, HostMemory(10 * GEOM.full_block_bytes, pin=pin))
    p.memory.tensor.copy_(torch.randint(0, 256, (p.memory.nbytes,), dtype=torch.uint8))
    return p


def reference(p, slots, layer):
    """``layer`` of ``slots`` cut from the raw bytes block by block, as token rows."""
    lb = GEOM.layer_block_bytes
    parts = [p.memory.tensor[p.layout.offset(s, layer) :][:lb] for s in slots]
    return torch.cat(parts).view(torch.bfloat16).view(-1, GEOM.kv_elems_per_token)


@pytest.mark.parametrize("layer", [0, 2])
def test_layer_to_and_from_host_tensors(layer):
    p = pool()
    out = torch.empty(len(SLOTS) * 4, 6, dtype=torch.bfloat16)
    p.layer_to_device(SLOTS, layer, out)
    assert torch.equal(out.view(torch.uint8), reference(p, SLOTS, layer).view(torch.uint8))
    before = p.memory.tensor.clone()
    rows = torch.randn(len(SLOTS) * 4, 6).to(torch.bfloat16)
    p.layer_from_device(SLOTS, layer, rows)
    assert torch.equal(reference(p, SLOTS, layer).view(torch.uint8), rows.view(torch.uint8))
    other = (layer + 1) % 3  # the other layers of those slots, and every other slot, untouched
    assert torch.equal(
        reference(p, range(10), other).view(torch.uint8).reshape(-1),
        torch.cat([before[s * GEOM.full_block_bytes + other * 48 :][:48] for s in range(10)]),
    )


def test_rows_that_do_not_fit_are_refused():
    host = HostMemory(4096)
    with pytest.raises(ValueError, match="do not fit"):
        copy_rows(host, 4000, 100, torch.empty(2, 64, dtype=torch.uint8), to_host=False)
    with pytest.raises(ValueError, match="contiguous"):
        pool().layer_to_device([1, 2], 0, torch.empty(6, 8, dtype=torch.bfloat16)[:, :6])


@cuda
@pytest.mark.parametrize("pin", [True, False])  # a 2-D DMA per run from pinned memory; row copies from pageable
def test_cuda_layer_copies_equal_block_by_block_copies(pin):
    p = pool(pin=pin)
    assert p.memory.pinned == pin
    stream = torch.cuda.Stream()
    for layer in range(3):
        out = torch.full((len(SLOTS) * 4, 6), float("nan"), dtype=torch.bfloat16, device="cuda")
        stream.wait_stream(torch.cuda.current_stream())  # the fill first: the copy stream is the caller's to order
        p.layer_to_device(SLOTS, layer, out, stream)
        stream.synchronize()
        assert torch.equal(out.cpu().view(torch.uint8), reference(p, SLOTS, layer).view(torch.uint8))
        rows = torch.randn(len(SLOTS) * 4, 6, device="cuda").to(torch.bfloat16)
        p.layer_from_device(SLOTS, layer, rows)  # done on return: no synchronize here
        assert torch.equal(reference(p, SLOTS, layer).view(torch.uint8), rows.cpu().view(torch.uint8))


@cuda
def test_cuda_pinned_runs_are_one_dma_each(monkeypatch):
    from dualpath.traffic import strided_copy

    runtime = strided_copy._cupy_runtime()
    if runtime is None:
        pytest.skip("cupy is not installed")
    calls = []
    real = runtime.memcpy2DAsync
    monkeypatch.setattr(runtime, "memcpy2DAsync", lambda *a: (calls.append(a[5]), real(*a)))
    p = pool(pin=True)
    out = torch.empty(len(SLOTS) * 4, 6, dtype=torch.bfloat16, device="cuda")
    p.layer_to_device(SLOTS, 1, out)
    torch.cuda.synchronize()
    assert calls == [3, 2, 1, 1]  # rows per DMA: the runs
    assert torch.equal(out.cpu().view(torch.uint8), reference(p, SLOTS, 1).view(torch.uint8))
