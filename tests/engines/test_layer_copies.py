"""Prefill's host-to-device copy stream: inline on CPU; on CUDA ordered with compute by events only (run by
bench/gpu/run.sh on a GPU machine)."""

import pytest
import torch

from dualpath.engines.layer_copies import LayerCopies


def test_cpu_copies_run_inline_and_ordering_is_a_no_op():
    copies, slot, seen = LayerCopies(torch.device("cpu")), torch.zeros(4), []
    copies.issue(0, 0, lambda stream: (seen.append(stream), slot.fill_(3)))
    assert seen == [None] and slot.tolist() == [3.0] * 4
    copies.before_compute(0)
    copies.after_compute(0)()  # nothing to wait for on CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_into_a_slot_waits_for_the_compute_reading_it():
    dev = torch.device("cuda")
    copies = LayerCopies(dev)
    n = 1 << 24
    slot = torch.zeros(n, device=dev)
    ones, twos = torch.ones(n).pin_memory(), torch.full((n,), 2.0).pin_memory()
    copies.issue(0, 0, lambda s: slot.copy_(ones, non_blocking=True))
    copies.before_compute(0)
    torch.cuda._sleep(200_000_000)  # the compute stream is busy for a while before it reads the slot
    first = slot.sum()
    copies.after_compute(0)
    copies.issue(2, 0, lambda s: slot.copy_(twos, non_blocking=True))  # must not land before `first` is read
    copies.before_compute(2)
    second = slot.sum()
    assert (first.item(), second.item()) == (n, 2 * n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_wait_for_the_compute_returns_once_the_layer_has_run():
    """What the pipeline's sender thread does before a transport reads a slot: the slot's compute has finished;
    recording it does not block the thread that launches compute."""
    dev = torch.device("cuda")
    copies = LayerCopies(dev)
    slot = torch.zeros(1 << 20, device=dev)
    torch.cuda._sleep(200_000_000)  # a long layer
    slot.fill_(7.0)
    computed = copies.after_compute(0)
    assert not copies._slot_free[0].query()  # still running: after_compute did not wait
    computed()
    assert copies._slot_free[0].query()
    assert float(slot.cpu()[0]) == 7.0
