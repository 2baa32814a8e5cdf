"""Single-process continuous batching over one model and one paged cache.

This is the reference runtime: ``dualpath.LLM`` drives it, and the multi-process runtime must produce exactly
what it produces. Each step either prefills newly admitted sequences (chunked to a token budget) or decodes one
token for every running sequence; when the cache runs out during decode, the newest sequence is preempted
(its blocks freed, its tokens recomputed later).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import numpy as np
import torch

from dualpath.core.config import SpeculativeConfig
from dualpath.core.errors import RequestError
from dualpath.core.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, stop_cut
from dualpath.engines.graphs import DecodeGraphs
from dualpath.engines.guided import GuideSource
from dualpath.engines.kv_cache import PagedKVCache
from dualpath.engines.models.base import CausalLM, ForwardBatch
from dualpath.engines.parallel.ranks import Ranks
from dualpath.engines.parallel.steps import RankState, decode_graph, forward_paged, logits_of, make_graphs
from dualpath.engines.sampler import check_token_ids, extend_prompt_logprobs, sample
from dualpath.engines.sequence import FinishReason, Sequence


class ModelRunner:
    """Runs a forward over sequences whose earlier KV is in a paged cache, writing the new KV back into it.
    Decode steps replay ``graphs`` when given and the batch fits them. ``ranks``: a tensor-parallel engine's ranks,
    each forward a step they all run (``cache`` is rank 0's, of its heads); None: this process alone."""

    def __init__(
        self, model: CausalLM, cache: PagedKVCache, graphs: DecodeGraphs | None = None, ranks: Ranks | None = None
    ):
        self.model, self.cache = model, cache
        if ranks is None:
            ranks = Ranks(RankState(model, None, str(cache.device)))
            ranks.state.cache = cache
        self.ranks = ranks
        if graphs is not None:
            self.graphs = graphs

    @property
    def graphs(self) -> DecodeGraphs | None:
        """Rank 0's decode graphs (each rank holds its own, over its cache)."""
        return self.ranks.state.graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        self.ranks.state.graphs = graphs

    def capture(self, max_batch: int, max_model_len: int, enforce_eager: bool, capture: bool = True) -> None:
        """Decode graphs on every rank (``dualpath.engines.parallel.steps.make_graphs``); eager steps where they do not
        apply. ``capture`` False: the graphs' buffers run eagerly (tests of everything but the capture, on CPU)."""
        self.ranks.run(make_graphs, max_batch, max_model_len, enforce_eager, capture)

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], new_lens: list[int]) -> torch.Tensor:
        """Feed each sequence its next ``new_lens[i]`` tokens; returns logits of each one's last fed token."""
        if self.graphs is not None and all(n == 1 for n in new_lens):
            tables = [self.cache.block_table(s.seq_id) for s in seqs]
            adapters = [s.params.adapter for s in seqs]
            if self.graphs.fits(len(seqs), max(map(len, tables)), adapters):
                return self._decode_graph(seqs, tables, adapters)
        hidden, logits = self._layers(
            seqs,
            new_lens,
            [s.token_ids[s.num_computed : s.num_computed + n] for s, n in zip(seqs, new_lens)],
            last_only=True,
        )
        self._prompt_logprobs(seqs, new_lens, hidden)
        for s, n in zip(seqs, new_lens):
            s.num_computed += n
        return logits

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """Feed each decoding sequence its last token and its drafts; logits of every fed row, packed in order.
        ``num_computed`` is left as it was: the caller knows how many drafts hold."""
        new_lens = [1 + len(d) for d in drafts]
        return self._layers(seqs, new_lens, [[s.last_token, *d] for s, d in zip(seqs, drafts)], last_only=False)[1]

    def _layers(self, seqs: list[Sequence], new_lens: list[int], fed: list[list[int]], last_only: bool):
        """Run every layer over tokens ``fed[i]`` at sequence i's next positions, writing their KV into the cache:
        ``(hidden states of every fed token, logits of each sequence's last fed token, or of every one)``."""
        batch = ForwardBatch(
            tuple(s.num_computed for s in seqs), tuple(new_lens), tuple(s.params.adapter for s in seqs)
        )
        ids = np.concatenate([np.asarray(f, dtype=np.int64) for f in fed])
        slots = np.concatenate(
            [np.asarray(self.cache.slots(s.seq_id, s.num_computed, n), dtype=np.int64) for s, n in zip(seqs, new_lens)]
        )
        tables = self.cache.padded_tables([s.seq_id for s in seqs])
        return self.ranks.run(
            forward_paged, batch, ids, slots, tables, batch.last_token_indices() if last_only else None
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden-state rows of the last forward (on every rank: the rows travel with the step)."""
        return self.ranks.run(logits_of, hidden.cpu() if self.ranks.size > 1 else hidden)

    def _prompt_logprobs(self, seqs: list[Sequence], new_lens: list[int], hidden: torch.Tensor) -> None:
        """Each asking sequence's prompt logprobs from this chunk's rows (``hidden`` packs the sequences' new
        tokens in order)."""
        start = 0
        for s, n in zip(seqs, new_lens):
            if s.params.prompt_logprobs is not None:
                extend_prompt_logprobs(
                    s.prompt_logprobs,
                    s.prompt_ids,
                    s.num_computed,
                    hidden[start : start + n],
                    self.logits,
                    s.params.prompt_logprobs,
                )
            start += n

    def _decode_graph(self, seqs: list[Sequence], tables: list[list[int]], adapters: list[str]) -> torch.Tensor:
        positions = [s.num_computed for s in seqs]
        tokens = [s.token_ids[p] for s, p in zip(seqs, positions)]
        slots = [self.cache.slots(s.seq_id, p, 1)[0] for s, p in zip(seqs, positions)]
        logits = self.ranks.run(decode_graph, tokens, positions, slots, tables, adapters)
        for s in seqs:
            s.num_computed += 1
        return logits


class LocalEngine:
    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        tokenizer: Tokenizer | None = None,
        free_finished: bool = True,
        enforce_eager: bool = False,
        speculative: SpeculativeConfig | None = None,
        ranks: Ranks | None = None,
    ):
        self.cache = cache
        self.spec = speculative or SpeculativeConfig()
        self.spec_stats = {"steps": 0, "drafted": 0, "accepted": 0}  # speculative steps, draft tokens fed, kept
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = model.config.context_limit(max_model_len)
        self.runner = ModelRunner(model, cache, ranks=ranks)
        self.runner.capture(max_num_seqs, self.max_model_len, enforce_eager)
        self.eos_ids = model.config.eos_token_ids
        self.vocab_size = model.config.vocab_size
        self.tokenizer = tokenizer
        self.guides = (
            GuideSource(lambda: tokenizer, model.config.vocab_size, model.config.eos_token_ids) if tokenizer else None
        )
        self.free_finished = free_finished  # False: the caller frees a finished sequence's blocks (after using them)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilled: deque[Sequence] = deque()  # prompt KV in place, waiting for one of max_num_seqs rows
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        if not seq.prompt_ids:
            raise RequestError("empty prompt", field="prompt")
        if seq.num_tokens >= self.max_model_len:
            raise RequestError(
                f"prompt has {seq.num_tokens} tokens; the model's context is {self.max_model_len}", field="prompt"
            )
        if self.cache.geometry.num_blocks(seq.num_tokens + 1) + len(seq.forks) > self.cache.allocator.num_blocks:
            raise RequestError("prompt does not fit in the KV cache", field="prompt")
        if 1 + len(seq.forks) > self.max_num_seqs:
            raise RequestError(f"n ({1 + len(seq.forks)}) exceeds max_num_seqs ({self.max_num_seqs})", field="n")
        check_token_ids(seq.params, self.vocab_size, seq.prompt_ids)
        self.runner.model.check_adapter(seq.params.adapter)
        if seq.params.structured and self.guides is None:
            raise RequestError("structured output needs the engine's tokenizer", field="response_format")
        for s in (seq, *seq.forks):
            self._prepare(s)
        self.waiting.append(seq)

    def _prepare(self, s: Sequence) -> None:
        """Its guide and stop-string detokenizer (each choice has its own), both past a resumed reply's tokens."""
        if s.params.structured and s.guide is None:
            s.guide = self.guides.guide_for(s.params, s.resumed)
        if s.params.stop and self.tokenizer is not None:
            detok = self._detok[s.seq_id] = IncrementalDetokenizer(
                self.tokenizer, s.prompt_ids, s.params.skip_special_tokens
            )
            for tok in s.resumed:  # read, not checked: they ended nothing where they were generated
                detok.add(tok)

    def admit_prefilled(self, seq: Sequence) -> bool:
        """Run a sequence whose prompt KV is already in the cache (``num_computed`` set, blocks reserved, its
        first tokens appended): the decode engine's entry, after a prefill engine handed the prompt over. False if
        those tokens already end it at a stop string: it does not run."""
        self._prepare(seq)
        for tok in seq.output_ids[seq.params.num_resumed_tokens :]:
            self._check_stop_strings(seq, tok)
        if seq.finished:
            self._detok.pop(seq.seq_id, None)
            return False
        self.prefilled.append(seq)
        self.promote()
        return True

    def promote(self) -> None:
        """Prefilled sequences join the decode batch while it has fewer than ``max_num_seqs`` rows (CUDA graphs
        are captured up to that size; a larger batch would run eagerly)."""
        while self.prefilled and len(self.running) < self.max_num_seqs:
            self.running.append(self.prefilled.popleft())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled)

    def step(self) -> list[Sequence]:
        """One forward. Returns the sequences that finished in it (their blocks already freed)."""
        batch, new_lens = self._schedule_prefill()
        if not batch:
            batch = self._schedule_decode()
            drafts = self._drafts(batch)
            if any(drafts):
                return self._speculative_step(batch, drafts)
            new_lens = [1] * len(batch)
        if not batch:
            return []
        logits = self.runner.forward(batch, new_lens)
        done_rows, seqs = [], []
        for i, s in enumerate(batch):
            if s.num_computed == s.num_tokens:  # a fork samples its first token from its prompt's row
                choices = self._fork(s)
                done_rows += [i] * len(choices)
                seqs += choices
        if done_rows != list(range(len(batch))):  # a chunked prompt's rows have nothing to sample (indexing copies)
            logits = logits[done_rows]
        tokens, logprobs = sample(
            logits,
            [s.params for s in seqs],
            [s.generator for s in seqs],
            [s.mask() for s in seqs],
            [s.history for s in seqs],
            self.eos_ids,
        )
        finished = [s for s, tok, lp in zip(seqs, tokens, logprobs) if self._take(s, tok, lp)]
        for s in finished:
            self.release(s)
        return finished

    def _take(self, s: Sequence, token: int, logprob) -> bool:
        """Append a drawn token; whether it ended the sequence."""
        s.append(token, logprob, self.eos_ids, self.max_model_len)
        self._check_stop_strings(s, token)
        return s.finished

    def _drafts(self, batch: list[Sequence]) -> list[list[int]]:
        """Each decoding sequence's proposals (``SpeculativeConfig``), no more than its budget leaves room to keep
        (the tokens of one step are at most the drafts plus one) and only where their KV fits the cache."""
        spec, out = self.spec, []
        if not spec.num_tokens:
            return out
        for s in batch:
            k = min(spec.num_tokens, s.params.max_tokens - len(s.output_ids) - 1, self.max_model_len - s.num_tokens - 1)
            d = s.drafts(k, spec.min_n, spec.max_n) if k > 0 else []
            need = self.cache.blocks_needed(s.seq_id, s.num_tokens + len(d)) if d else 0
            if need > self.cache.num_free_blocks:
                d = []
            elif need:
                self.cache.reserve(s.seq_id, s.num_tokens + len(d))
            out.append(d)
        return out

    def _speculative_step(self, batch: list[Sequence], drafts: list[list[int]]) -> list[Sequence]:
        """One forward over every sequence's last token and drafts, then the tokens drawn position by position:
        each position of the sequences still going is drawn as a plain step would draw it (its logits are those of
        the true prefix, since every earlier draft equalled its drawn token), and a sequence stops at its first draft
        that differs, its end, or its last draft (whose row gives one more token)."""
        before = [s.num_tokens for s in batch]
        logits = self.runner.verify(batch, drafts)
        first = np.cumsum([0] + [1 + len(d) for d in drafts[:-1]])
        going, depth, finished = list(range(len(batch))), 0, []
        while going:
            seqs = [batch[i] for i in going]
            tokens, logprobs = sample(
                logits[[int(first[i]) + depth for i in going]],
                [s.params for s in seqs],
                [s.generator for s in seqs],
                [s.mask() for s in seqs],
                [s.history for s in seqs],
                self.eos_ids,
            )
            on = []
            for i, s, tok, lp in zip(going, seqs, tokens, logprobs):
                if self._take(s, tok, lp):
                    finished.append(s)
                elif depth < len(drafts[i]) and tok == drafts[i][depth]:
                    on.append(i)
            going, depth = on, depth + 1
        for s in batch:  # the KV of every kept token but the newest is in place; later rows get overwritten
            s.num_computed = s.num_tokens - 1
        self.spec_stats["steps"] += 1
        self.spec_stats["drafted"] += sum(map(len, drafts))
        self.spec_stats["accepted"] += sum(s.num_tokens - b - 1 for s, b in zip(batch, before))  # beyond one each
        for s in finished:
            self.release(s)
        return finished

    def abort(self, seq_id: str) -> None:
        for s in list(self.waiting) + self.running:
            if s.seq_id == seq_id:
                s.finish_reason = FinishReason.ABORT
                if s in self.waiting:
                    self.waiting.remove(s)
                self.release(s)

    def _fork(self, s: Sequence) -> list[Sequence]:
        """``s`` and the choices that were waiting for its prompt, now sharing its prompt's blocks and running."""
        for f in s.forks:
            self.cache.fork(s.seq_id, f.seq_id, s.num_computed)
            f.num_computed, f.prompt_logprobs = s.num_computed, s.prompt_logprobs
            self.running.append(f)
        out, s.forks = [s, *s.forks], []
        return out

    def release(self, s: Sequence) -> None:
        """``s`` stops running (finished or dropped); its blocks are freed unless the caller frees them."""
        if s in self.running:
            self.running.remove(s)
        if s in self.prefilled:
            self.prefilled.remove(s)
        if self.free_finished:
            self.cache.free(s.seq_id)
        for f in s.forks:  # aborted before its prompt was computed: the choices never start
            f.finish_reason = FinishReason.ABORT
            self.cache.free(f.seq_id)
            self._detok.pop(f.seq_id, None)
        self._detok.pop(s.seq_id, None)

    def _check_stop_strings(self, s: Sequence, token: int) -> None:
        detok = self._detok.get(s.seq_id)
        if detok is None or s.finish_reason is FinishReason.STOP:
            return  # a stop string in the token that also hit max_tokens still counts
        before = len(detok.text)
        detok.add(token)
        if len(s.output_ids) < s.params.min_tokens:
            return  # min_tokens: stop strings do not end the reply yet
        longest = max(len(x) for x in s.params.stop)
        idx = find_stop(detok.text, s.params.stop, max(0, before - longest + 1))
        if idx >= 0:
            cut = stop_cut(detok.text, s.params.stop, idx, s.params.include_stop_str_in_output)
            s.finish_reason, s.stop_text = FinishReason.STOP, detok.text[:cut]

    def _schedule_prefill(self) -> tuple[list[Sequence], list[int]]:
        batch, new_lens, budget = [], [], self.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) + 1 + len(self.waiting[0].forks) <= self.max_num_seqs:
            s = self.waiting[0]
            n = min(s.num_tokens - s.num_computed, budget)
            # Admit only if the whole sequence (and its next token) fits, with a block of its own for each of its
            # forks (the copy of the partial last block, or the next token's), so an admitted prefill never stalls.
            need = self.cache.blocks_needed(s.seq_id, s.num_tokens + 1) + sum(
                self.cache.fork_blocks_needed(f.seq_id, s.num_tokens, s.num_tokens + 1) for f in s.forks
            )
            if need > self.cache.num_free_blocks:
                break
            self.cache.reserve(s.seq_id, s.num_tokens + 1)
            for f in s.forks:
                self.cache.reserve_fork(f.seq_id, s.num_tokens, s.num_tokens + 1)
            batch.append(s)
            new_lens.append(n)
            budget -= n
            if s.num_computed + n == s.num_tokens:
                self.waiting.popleft()
                self.running.append(s)
            else:
                break  # a chunked prompt continues next step, ahead of everything else
        return batch, new_lens

    def _schedule_decode(self) -> list[Sequence]:
        self.promote()
        while self.running:
            need = sum(self.cache.blocks_needed(s.seq_id, s.num_tokens + 1) for s in self.running)
            if need <= self.cache.num_free_blocks:
                break
            self._preempt(self.running.pop())
        for s in self.running:
            self.cache.reserve(s.seq_id, s.num_tokens + 1)
        return list(self.running)

    def _preempt(self, s: Sequence) -> None:
        self.cache.free(s.seq_id)
        s.num_computed = 0
        self.waiting.appendleft(s)


def run_to_completion(engine: LocalEngine, seqs: Iterable[Sequence], progress=None) -> None:
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        done = engine.step()
        if progress is not None and done:
            progress.update(len(done))
