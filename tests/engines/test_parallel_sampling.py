"""Parallel sampling (``SamplingParams.n``): the prompt is computed once, the choices share its full blocks
(reference-counted) and copy its partial one, and choice i samples exactly what a request of its own with
seed + i samples. The cluster's path (one load, the decode engine's forks) is in ``test_serving``."""

from collections import Counter
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dualpath import LLM, SamplingParams
from dualpath.core.allocator import BlockAllocator
from dualpath.core.errors import RequestError
from dualpath.core.geometry import KVGeometry
from dualpath.engines.kv_cache import PagedKVCache
from dualpath.engines.sampler import make_generator
from dualpath.engines.sequence import Sequence

BS = 16


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(str(tiny_dirs["llama"]), block_size=BS)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["alloc", "share", "free"]), st.integers(0, 7), st.integers(1, 4)), max_size=50)
)
def test_shared_blocks_are_free_again_only_after_their_last_holder(ops):
    alloc, holders, lists = BlockAllocator(12), Counter(), []
    for op, pick, n in ops:
        if op == "alloc" and alloc.num_free >= n:
            lists.append(alloc.allocate(n))
            holders.update(lists[-1])
        elif op == "share" and lists:
            blocks = lists[pick % len(lists)]
            alloc.share(blocks)
            lists.append(list(blocks))
            holders.update(blocks)
        elif op == "free" and lists:
            blocks = lists.pop(pick % len(lists))
            alloc.free(blocks)
            holders.subtract(blocks)
        alloc.check()
        assert all(alloc.holders(b) == holders[b] for b in range(12))
        assert alloc.num_free == sum(holders[b] == 0 for b in range(12))


def test_a_fork_shares_full_blocks_and_copies_the_partial_one():
    g = KVGeometry(num_layers=3, kv_elems_per_token=4, dtype="float32", block_size=4)
    cache = PagedKVCache(g, 16)
    cache.storage.copy_(torch.randn_like(cache.storage))
    cache.reserve("p", 10)  # two full blocks and a partial one
    cache.reserve_fork("c", 10, 13)  # 13 - 8 = 5 own tokens: two blocks
    assert len(cache.block_table("c")) == 2
    own = cache.block_table("c")[0]
    cache.fork("p", "c", 10)
    p, c = cache.block_table("p"), cache.block_table("c")
    assert c[:2] == p[:2] and c[2] == own and own not in p
    assert torch.equal(cache.storage[:, own], cache.storage[:, p[2]])  # every layer's KV of the partial block
    cache.fork("p", "d", 8)  # at a block boundary nothing is copied (nor allocated)
    assert cache.block_table("d") == p[:2]
    cache.check()
    before = cache.storage[:, p[2]].clone()
    cache.storage[:, own] = 0  # the fork's writes stay its own
    assert torch.equal(cache.storage[:, p[2]], before)
    for seq in ("p", "d", "c"):
        cache.free(seq)
        cache.check()
    assert cache.num_free_blocks == 16


def seeded(n, **kw):
    return SamplingParams(temperature=1.0, max_tokens=12, seed=5, ignore_eos=True, n=n, **kw)


def test_choices_equal_requests_of_their_own_and_the_prompt_runs_once(llm):
    prompts = [list(range(3, 3 + k)) for k in (37, 32, 1)]  # a partial last block, whole blocks, one token
    fed = []
    forward = llm.engine.runner.forward
    llm.engine.runner.forward = lambda seqs, lens: fed.append(sum(lens)) or forward(seqs, lens)
    try:
        outs = llm.generate(prompts, seeded(3))
    finally:
        llm.engine.runner.forward = forward
    assert sum(fed) == sum(map(len, prompts)) + 3 * len(prompts) * 11  # prompts once; every choice's 11 steps
    assert [(o.index, o.prompt_token_ids) for o in outs] == [(i, p) for p in prompts for i in range(3)]
    for k, p in enumerate(prompts):
        for i in range(3):
            alone = llm.generate(p, replace(seeded(1), seed=5 + i))[0]
            assert outs[3 * k + i].token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3  # the choices differ
    greedy = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8, n=4))
    assert len({tuple(o.token_ids) for o in greedy}) == 1
    llm.cache.check()
    assert llm.cache.num_free_blocks == llm.cache.allocator.num_blocks


def test_forks_survive_preemption_and_chunked_prefill(tiny_dirs, llm):
    """A cache too small for every choice at once: forks are preempted (their shared blocks stay with the
    others), recomputed alone, and still sample what they would have."""
    prompts = [list(range(5, 5 + k)) for k in (40, 23)]
    want = [o.token_ids for o in llm.generate(prompts, seeded(3))]
    small = LLM(str(tiny_dirs["llama"]), block_size=BS, num_kv_blocks=10, max_num_batched_tokens=24)
    preempted, preempt = [], small.engine._preempt
    small.engine._preempt = lambda s: preempted.append(s.index) or preempt(s)
    assert [o.token_ids for o in small.generate(prompts, seeded(3))] == want
    assert preempted and any(i > 0 for i in preempted)
    small.cache.check()
    assert small.cache.num_free_blocks == 10


def test_choices_stop_on_their_own_and_share_the_prompt_logprobs(llm):
    prompt = list(range(7, 40))
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3, n=3, prompt_logprobs=1)
    outs = llm.generate(prompt, params)
    stop_text = outs[1].text[2:4]
    stopped = llm.generate(prompt, replace(params, stop=(stop_text,)))
    assert stopped[1].finish_reason == "stop" and stopped[1].text == outs[1].text[: outs[1].text.find(stop_text)]
    for full, cut in zip(outs, stopped):
        assert full.text.startswith(cut.text) and full.prompt_logprobs == cut.prompt_logprobs
    assert outs[0].prompt_logprobs == outs[2].prompt_logprobs and len(outs[0].prompt_logprobs) == len(prompt)


def test_n_is_checked(llm, tiny_dirs):
    for n in (0, 17):
        with pytest.raises(RequestError, match="n must be"):
            SamplingParams(n=n)
    narrow = LLM(str(tiny_dirs["llama"]), block_size=BS, max_num_seqs=2)
    with pytest.raises(RequestError, match="max_num_seqs"):
        narrow.generate([1, 2, 3], SamplingParams(n=3))


def test_aborting_a_request_before_its_prompt_ran_frees_its_choices(llm):
    params = seeded(3)
    seq = Sequence.choices("abort-me", list(range(50)), params, [make_generator(params, i) for i in range(3)])
    llm.engine.add(seq)
    llm.engine.max_num_batched_tokens, budget = 16, llm.engine.max_num_batched_tokens
    try:
        llm.engine.step()  # the first chunk: the prompt and its choices' own blocks are reserved
        assert llm.cache.num_free_blocks < llm.cache.allocator.num_blocks
        forks = list(seq.forks)
        llm.engine.abort("abort-me")
    finally:
        llm.engine.max_num_batched_tokens = budget
    assert all(f.finish_reason.value == "abort" for f in forks) and not llm.engine.has_work()
    llm.cache.check()
    assert llm.cache.num_free_blocks == llm.cache.allocator.num_blocks


def test_the_generate_command_prints_every_choice(tiny_dirs, capsys):
    from dualpath.cli import main

    args = [
        "generate",
        "--model",
        str(tiny_dirs["llama"]),
        "--prompt",
        "ab",
        "cd",
        "-n",
        "3",
        "--temperature",
        "1",
        "--seed",
        "4",
        "--max-tokens",
        "3",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("> ab\n") == 1 and out.count("> cd\n") == 1
    assert [out.count(f"[choice {i}, 3 tokens") for i in range(3)] == [2, 2, 2]


def test_prefilled_sequences_wait_for_a_decode_row(tiny_dirs, llm):
    """The decode engine's entry: sequences handed over with their prompt's KV in place join the batch only while
    it has fewer than ``max_num_seqs`` rows (CUDA graphs are captured up to that size); the rest wait their turn
    and generate what they would have."""
    from dualpath.engines.local import LocalEngine

    prompts = [list(range(3, 3 + k)) for k in (20, 9, 33, 4, 17)]
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))]
    seqs = [Sequence(f"handed-{i}", p, SamplingParams(temperature=0, max_tokens=6)) for i, p in enumerate(prompts)]
    for s in seqs:
        llm.engine.add(s)
    llm.engine.step()  # every prompt prefilled, first tokens sampled: as a prefill engine hands them over
    llm.engine.running.clear()
    decode = LocalEngine(llm.model, llm.cache, max_num_seqs=2)
    assert all(decode.admit_prefilled(s) for s in seqs)
    rows, forward = [], decode.runner.forward
    decode.runner.forward = lambda batch, lens: rows.append(len(batch)) or forward(batch, lens)
    while decode.has_work():
        decode.step()
    assert max(rows) == 2 and [s.output_ids for s in seqs] == want
    llm.cache.check()
    assert llm.cache.num_free_blocks == llm.cache.allocator.num_blocks
