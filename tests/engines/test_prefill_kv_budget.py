"""A prefill engine's device-memory budget for a batch's resident KV (``prefill_kv_budget_bytes``): a basic
(non-layerwise) batch must hold every layer of its KV at once, a layerwise one two layers, so one budget admits a
smaller basic batch; what does not fit waits for the next batch, and a prompt that can never fit fails at once."""

from dataclasses import replace

import pytest
import torch

from dualpath.core.messages import Assignment, ReadPath, pack_tokens
from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.models import ForwardBatch
from dualpath.engines.prefill import Job, PrefillEngine
from dualpath.engines.sampler import make_generator
from dualpath.kernels.kv_move import layer_tokens_from_full
from engine_doubles import engine_config, prefill_with_decode_peer

BS = 16
BUDGET_LAYER_BLOCKS = 12  # the tiny Llama has 3 layers: basic holds 12 / 3 = 4 blocks, layerwise 12 / 2 = 6


def job_of(pe, peer, rid: str, n_tokens: int, layerwise: bool) -> Job:
    tokens = list(range(3, 3 + n_tokens))
    params = SamplingParams(temperature=0, max_tokens=1)
    a = Assignment(rid, tokens, params.to_dict(), [], ReadPath.PE, layerwise, peer.info)
    job = Job(a, params, [make_generator(params)], 0, tokens)
    blocks = pe.geometry.num_blocks(n_tokens)
    job.pe_slots = pe.buffer.allocate(blocks, rid)
    job.de_slots = peer.pool.allocate(blocks, rid)
    return job


@pytest.fixture
def budgeted(tiny_dirs, tmp_path):
    """(prefill engine with a budget of 12 layer blocks, decode peer)."""
    with prefill_with_decode_peer(tiny_dirs["llama"], tmp_path, BS) as (pe, peer):
        pe.cfg = replace(pe.cfg, prefill_kv_budget_bytes=BUDGET_LAYER_BLOCKS * pe.geometry.layer_block_bytes)
        pe.workspace = pe._workspace(layerwise=True)
        yield pe, peer


def test_basic_batch_fits_all_layers_in_the_budget(budgeted):
    pe, peer = budgeted
    g = pe.geometry
    basic = [job_of(pe, peer, f"b{i}", 2 * BS, layerwise=False) for i in range(3)]
    # all layers of two 2-block prompts fill the 12 layer blocks: the third waits for the next batch
    assert [j.work_id for j, n in pe._choose(basic)] == ["b0", "b1"]
    layerwise = [job_of(pe, peer, f"l{i}", 2 * BS, layerwise=True) for i in range(3)]
    assert [j.work_id for j, n in pe._choose(layerwise)] == ["l0", "l1", "l2"]  # two layers resident: all fit

    ws = pe._basic_workspace()
    assert ws.blocks == 4 and ws.tensor.numel() * ws.tensor.element_size() <= pe.cfg.prefill_kv_budget_bytes
    batch = pe._choose(basic)
    pe._prefill(batch, ws, basic=True)  # real tensors through the budgeted workspace
    for job, _ in batch:
        with torch.inference_mode():
            _, want = pe.model.forward_all(torch.tensor(job.token_ids), ForwardBatch((0,), (job.n_prompt,)))
        full = peer.pool.full_blocks(job.de_slots)
        for layer in range(g.num_layers):
            got = layer_tokens_from_full(full, layer, g)[: job.n_prompt]
            assert torch.allclose(got, want[layer], atol=1e-5), (job.work_id, layer)


def test_without_a_budget_basic_takes_the_whole_queue(tiny_dirs, tmp_path):
    with prefill_with_decode_peer(tiny_dirs["llama"], tmp_path, BS) as (pe, peer):
        basic = [job_of(pe, peer, f"b{i}", 2 * BS, layerwise=False) for i in range(3)]
        assert len(pe._choose(basic)) == 3


def test_a_prompt_that_can_never_fit_fails_at_once(budgeted):
    pe, peer = budgeted
    tokens = list(range(3, 3 + 5 * BS))  # 5 blocks: over basic's 4, within layerwise's 6
    params = SamplingParams(temperature=0, max_tokens=1)
    pe.on_assignment(Assignment("big", pack_tokens(tokens), params.to_dict(), b"", ReadPath.PE, False, peer.info))
    failed = pe.outbox.take()["failed"]
    assert [f[0] for f in failed] == ["big"] and "does not fit" in failed[0][1] and "basic" in failed[0][1]
    assert not list(pe.jobs.live())  # never queued: nothing waits for room that cannot come
    pe._check_fits(job_of(pe, peer, "lw", 5 * BS, layerwise=True))  # layerwise holds it


def test_a_budget_below_two_layer_blocks_is_refused(tiny_dirs, tmp_path):
    cfg = engine_config("prefill", tiny_dirs["llama"], tmp_path, BS, prefill_kv_budget_bytes=1)
    with pytest.raises(Exception, match="holds no block"):
        PrefillEngine(cfg)
