"""The single-process reference runtime: paged cache, continuous batching, stops, preemption."""

import pytest
from hypothesis import given, settings, strategies as st

from dualpath import LLM, SamplingParams
from dualpath.core.errors import OutOfBlocksError, RequestError
from dualpath.core.allocator import BlockAllocator

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(str(tiny_dirs["llama"]), block_size=16)


def test_batch_equals_one_at_a_time(llm):
    prompts = [list(range(3, 3 + n)) for n in (4, 30, 17, 1)]
    batched = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, batched):
        assert llm.generate(p, GREEDY)[0].token_ids == out.token_ids
    llm.cache.check()
    assert llm.cache.num_free_blocks == llm.cache.allocator.num_blocks


def test_each_prompt_under_its_own_sampling_params(llm):
    """vLLM's list of SamplingParams, one per prompt: each prompt generates as it would alone under its own."""
    prompts = [list(range(3, 3 + n)) for n in (5, 12, 9)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 1)]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [3, 7, 1]
    for p, sp, out in zip(prompts, params, outs):
        assert llm.generate(p, sp)[0].token_ids == out.token_ids
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(prompts, params[:2])


def test_preemption_and_chunked_prefill_keep_outputs(tiny_dirs, llm):
    prompts = [list(range(5, 5 + n)) for n in (40, 35, 50, 20)]
    ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    small = LLM(str(tiny_dirs["llama"]), block_size=16, num_kv_blocks=9, max_num_batched_tokens=24)
    got = [o.token_ids for o in small.generate(prompts, GREEDY)]
    assert got == ref
    small.cache.check()


def test_stop_conditions(llm):
    out = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=7))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    first = out.token_ids[2]
    out2 = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[first]))[0]
    assert out2.token_ids == out.token_ids[:3] and out2.finish_reason == "stop"
    text = llm.tokenizer.decode(out.token_ids)
    stop = text[3:5]
    out3 = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=7, stop=[stop]))[0]
    assert out3.finish_reason == "stop" and out3.text == text[: text.find(stop)]


def test_ignore_eos_forces_length(tiny_dirs):
    llm = LLM(str(tiny_dirs["qwen2"]), block_size=16)
    eos = llm.model_config.eos_token_ids[0]
    # a prompt whose greedy continuation we make end at once: stop on its first token via eos ids
    out = llm.generate([10, 11], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    assert eos in llm.engine.eos_ids


def test_rejects_prompts_that_cannot_fit(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16, num_kv_blocks=2)
    with pytest.raises(RequestError, match="does not fit"):
        llm.generate(list(range(40)), GREEDY)
    with pytest.raises(RequestError, match="context"):
        LLM(str(tiny_dirs["llama"]), block_size=16, max_model_len=32).generate(list(range(40)), GREEDY)
    vocab = llm.model_config.vocab_size  # past the embedding table: on CUDA a device-side assert ending the process
    for bad in ([1, vocab], [-1, 2]):
        with pytest.raises(RequestError, match=rf"prompt: token ids must be in \[0, {vocab}\)"):
            llm.generate(bad, GREEDY)
    assert len(llm.generate([1, vocab - 1], GREEDY)[0].token_ids) == GREEDY.max_tokens  # the engine still serves


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_allocator_never_loses_or_duplicates_blocks(ops):
    alloc, held = BlockAllocator(16), []
    for is_alloc, n in ops:
        if is_alloc:
            try:
                held.append(alloc.allocate(n))
            except OutOfBlocksError:
                assert alloc.num_free < n
        elif held:
            alloc.free(held.pop(0))
        alloc.check()
        flat = [b for h in held for b in h]
        assert len(flat) == len(set(flat)) and alloc.num_free + len(flat) == 16


def test_freed_blocks_come_back_in_the_order_they_were_held():
    """Runs of consecutive ids survive reuse: a buffer's layer of a run of slots is one DMA, not one per slot."""
    alloc = BlockAllocator(16)
    first = alloc.allocate(6)
    assert first == [0, 1, 2, 3, 4, 5]
    alloc.free(first)
    assert alloc.allocate(4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([2, 2])
    assert alloc.num_free == 12  # the refused free changed nothing
    alloc.check()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 70), st.integers(1, 40), st.integers(0, 6))
def test_cache_slots_follow_the_block_table(start, n, spacer):
    """A token's slot is its block's id times the block size plus its offset, across block boundaries and for
    tables whose blocks are not consecutive."""
    from dualpath.core.geometry import KVGeometry
    from dualpath.engines.kv_cache import PagedKVCache

    cache = PagedKVCache(KVGeometry(num_layers=1, kv_elems_per_token=4, dtype="float32", block_size=8), 40)
    cache.reserve("spacer", 8 * spacer + 1)
    cache.reserve("s", start + n)
    table = cache.block_table("s")
    assert cache.slots("s", start, n) == [table[p // 8] * 8 + p % 8 for p in range(start, start + n)]


def test_generation_config_end_tokens_end_replies_as_in_transformers(tiny_dirs, tmp_path):
    """An end token named only in ``generation_config.json`` (Llama 3's and Qwen2.5's instruct checkpoints name
    their end of turn there) ends a reply, as transformers' ``generate`` ends it; ``ignore_eos`` still runs on."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    d = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], d)
    prompt, greedy = [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=12)
    free = LLM(str(d), block_size=16).generate(prompt, greedy)[0].token_ids
    end = free[3]
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [gen["eos_token_id"], end]}))
    llm = LLM(str(d), block_size=16)
    out = llm.generate(prompt, greedy)[0]
    assert out.finish_reason == "stop" and out.token_ids == free[: free.index(end) + 1]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert out.token_ids == want
    assert llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids == free


def test_generate_without_sampling_params_uses_the_generation_config(tiny_dirs, tmp_path):
    """vLLM's ``LLM``: ``generate`` with no ``SamplingParams`` samples as the checkpoint's generation config says
    (here greedy with 5 new tokens); ``generation_config="vllm"`` keeps ``SamplingParams``' own defaults."""
    import json
    import shutil

    d = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(str(d), block_size=16)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    out = llm.generate([5, 6, 7])[0]
    assert out.token_ids == llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=5))[0].token_ids
    assert LLM(str(d), block_size=16, generation_config="vllm").get_default_sampling_params() == SamplingParams()
