"""The prefill engine's layer loop in-process (one engine, a shared-memory peer standing in for the decode engine):
every layer's KV reaches the decode engine's buffer, and the wait for a layer's compute before its send is made by
the pipeline's sender thread, never by the thread launching the layers (on a GPU that wait is where the device
would sit idle)."""

import threading

import torch

from dualpath.core.messages import Assignment, ReadPath
from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.models import ForwardBatch
from dualpath.engines.prefill import Job
from dualpath.engines.sampler import make_generator
from dualpath.kernels.kv_move import layer_tokens_from_full
from engine_doubles import prefill_with_decode_peer

BS = 16


def test_sends_wait_for_compute_off_the_launching_thread(tiny_dirs, tmp_path):
    with prefill_with_decode_peer(tiny_dirs["llama"], tmp_path, BS) as (pe, peer):
        g, de, de_pool = pe.geometry, peer.info, peer.pool
        tokens = list(range(3, 3 + 3 * BS + 5))  # a prompt with nothing stored: every token computed here
        params = SamplingParams(temperature=0, max_tokens=1)
        a = Assignment("r", tokens, params.to_dict(), [], ReadPath.PE, True, de)
        job = Job(a, params, [make_generator(params)], 0, tokens)
        job.pe_slots = pe.buffer.allocate(g.num_blocks(len(tokens)), "r")
        job.de_slots = de_pool.allocate(g.num_blocks(len(tokens)), "r")

        engine_thread, waited_in = threading.current_thread(), []
        after = pe.copies.after_compute

        def spied(slot):
            wait = after(slot)
            return lambda: (waited_in.append(threading.current_thread()), wait())[1]

        pe.copies.after_compute = spied
        pe._prefill([(job, len(tokens))], pe.workspace, basic=False)
        assert len(waited_in) == g.num_layers and engine_thread not in waited_in

        # what the decode engine's buffer now holds is the prompt's KV, layer by layer
        with torch.inference_mode():
            _, want = pe.model.forward_all(torch.tensor(tokens), ForwardBatch((0,), (len(tokens),)))
        full = de_pool.full_blocks(job.de_slots)
        for layer in range(g.num_layers):
            got = layer_tokens_from_full(full, layer, g)[: len(tokens)]
            assert torch.allclose(got, want[layer], atol=1e-5), layer
