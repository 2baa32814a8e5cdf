"""Single-process offline inference: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

This is the reference the disaggregated runtime must match token for token.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch
from tqdm import tqdm

from dualpath.core.config import CacheConfig, EngineConfig, ParallelConfig, SpeculativeConfig
from dualpath.core.geometry import KVGeometry
from dualpath.core.sampling_params import SamplingParams, model_defaults
from dualpath.core.tokenizer import Tokenizer, TokenIdsOnly
from dualpath.engines.local import LocalEngine
from dualpath.engines.models import open_checkpoint
from dualpath.engines.parallel.ranks import RankSpec, check_parallel, start_ranks
from dualpath.engines.parallel.steps import (
    alloc_cache,
    cache_size,
    copy_block,
    forward_whole,
    load_adapter,
    update_weights,
)
from dualpath.engines.sampler import TokenLogprob, make_generator
from dualpath.engines.sequence import Sequence
from dualpath.kernels.attention import check_cache_dtype
from dualpath.kernels.kv_move import cache_dtype


@dataclass(frozen=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # asked for: None for the first token, then one each
    index: int = 0  # which of the prompt's ``n`` choices


class LLM:
    """A model and a paged KV cache in this process.

    ``num_kv_blocks`` (or ``kv_cache_bytes``) sizes the cache; both 0 (the default): on CUDA
    ``gpu_memory_utilization`` of the device less the weights and the activations of the largest forward (vLLM's
    rule), on a CPU 1 GiB (``dualpath.engines.memory``); ``block_size`` is the KV block geometry shared
    with storage. On CUDA with the Triton kernels, decode steps replay CUDA graphs captured here (one per padded
    batch size up to ``max_num_seqs``); ``enforce_eager`` turns that off. ``speculative_config`` (vLLM's: a dict or
    its JSON, ``{"method": "ngram", "num_speculative_tokens": 4}``) turns on speculative decoding by prompt lookup,
    which changes no output (``dualpath.core.config.SpeculativeConfig``). ``kv_cache_dtype`` (vLLM's ``auto`` or
    ``fp8``) is the cache's dtype; ``quantization`` (vLLM's ``"fp8"``) quantizes a plain checkpoint's linear
    weights to block-scaled FP8 as they load (both ``dualpath.core.config.EngineConfig``). ``generation_config``
    (vLLM's): where the sampling of a ``generate`` or ``chat`` without ``SamplingParams`` comes from: "auto", the
    checkpoint's ``generation_config.json`` over ``SamplingParams``' defaults; "vllm", those defaults alone; or a
    directory.
    ``tensor_parallel_size`` (vLLM's): the model's heads, MLP and vocabulary split across that many ranks, this
    process rank 0 and the others processes it starts on the next devices (``close`` stops them; CPU: gloo).
    ``lora_modules`` (name -> PEFT directory) are LoRA adapters loaded at once; ``generate``, ``chat`` and
    ``logits`` run a request under one when given its name or any adapter's directory as ``lora_request``
    (loaded on first use, as vLLM's ``LoRARequest``; ``generate`` also takes one per prompt, None for the base
    model, and decodes them in one batch), and the base model without.
    ``skip_tokenizer_init`` (vLLM's): the checkpoint's tokenizer is not loaded (it may have none): prompts must be
    token ids and outputs carry token ids with empty text; a text prompt, a chat, stop strings or structured output
    raise a RequestError saying so.
    """

    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: str = "float32",
        block_size: int = 64,
        kv_cache_bytes: int = 0,
        num_kv_blocks: int = 0,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        kernels: str = "auto",
        enforce_eager: bool = False,
        speculative_config: dict | str | None = None,
        kv_cache_dtype: str = "auto",
        generation_config: str = "auto",
        lora_modules: dict[str, str] | None = None,
        quantization: str | None = None,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        moe_dispatch: str = "all_to_all",
        skip_tokenizer_init: bool = False,
    ):
        self.config = EngineConfig(
            device=device,
            dtype=dtype,
            kernels=kernels,
            enforce_eager=enforce_eager,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization,
            max_num_seqs=max_num_seqs,
            speculative=SpeculativeConfig.parse(speculative_config),
            max_num_batched_tokens=max_num_batched_tokens,
            cache=CacheConfig(
                block_size=block_size,
                num_device_blocks=num_kv_blocks,
                device_memory_bytes=kv_cache_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size, enable_expert_parallel=enable_expert_parallel, moe_dispatch=moe_dispatch
            ),
        )
        ckpt = open_checkpoint(model, self.config.weight_quant)
        self.model_config = ckpt.config
        check_parallel(ckpt.config, self.config)
        # before any rank starts: a checkpoint without tokenizer.json fails here unless it is skipped
        self.tokenizer = TokenIdsOnly(ckpt.config.vocab_size) if skip_tokenizer_init else Tokenizer(model)
        # this process is rank 0; at tensor_parallel_size > 1 the others are processes it starts
        self.ranks = start_ranks(RankSpec(model, self.config, torch_threads=torch.get_num_threads()))
        self.model = self.ranks.state.model
        self.geometry = KVGeometry.for_model(ckpt.config, self.config.kv_dtype, block_size)
        check_cache_dtype(self.model.kernels, device, cache_dtype(self.geometry))
        # before the cache is sized and decode graphs are captured: both count these adapters
        self.adapters = {name: self.ranks.run(load_adapter, path) for name, path in (lora_modules or {}).items()}
        num_blocks = self.ranks.run(cache_size, self.config.cache, self.geometry, max_num_batched_tokens)
        self.cache = self.ranks.run(alloc_cache, self.geometry, num_blocks)
        if self.ranks.size > 1:
            self.cache.copier = lambda src, dst: self.ranks.run(copy_block, src, dst)
        engine_tokenizer = self.tokenizer if self.tokenizer.takes_text else None
        self.engine = LocalEngine(
            self.model,
            self.cache,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            engine_tokenizer,
            enforce_eager=enforce_eager,
            speculative=self.config.speculative,
            ranks=self.ranks,
        )
        self._ids = itertools.count()
        self._default_sampling = SamplingParams(**model_defaults(generation_config, model))

    def _adapter(self, lora_request: str | None) -> str:
        """The identity of the adapter named (or at the directory) ``lora_request``; "" for None."""
        if not lora_request:
            return ""
        if lora_request not in self.adapters:
            self.adapters[lora_request] = self.ranks.run(load_adapter, lora_request)
        return self.adapters[lora_request]

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no ``SamplingParams`` (vLLM's method)."""
        return self._default_sampling

    def update_weights(self, model: str) -> str:
        """Load checkpoint ``model``'s weights in place of the current ones (an RL trainer's new policy: the same
        config, other values); returns their sha256. The tokenizer stays the one loaded first."""
        return self.ranks.run(update_weights, model, self.config.weight_quant)

    def _prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str | Seq[int]],
        sampling: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids) under ``sampling``, or each under its own
        (a list as long as the prompts, vLLM's); outputs are in prompt order, a prompt's ``n`` choices one after
        another (``RequestOutput.index``), its KV computed once for all of them."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        samplings = (
            list(sampling)
            if isinstance(sampling, (list, tuple))
            else [sampling or self._default_sampling] * len(prompts)
        )
        loras = (
            [lora_request] * len(prompts)
            if lora_request is None or isinstance(lora_request, str)
            else list(lora_request)
        )
        for name, values in (("lora requests", loras), ("sampling params", samplings)):
            if len(values) != len(prompts):
                raise ValueError(f"{len(values)} {name} for {len(prompts)} prompts")
        if not self.tokenizer.takes_text:  # (the engine would otherwise ignore stop strings it cannot match)
            for s in samplings:
                self.tokenizer.check_sampling(s.stop, s.structured)
        params = [dataclasses.replace(s, adapter=self._adapter(lora)) for s, lora in zip(samplings, loras)]
        firsts = [
            Sequence.choices(
                f"llm-{next(self._ids)}", self._prompt_ids(p), s, [make_generator(s, i) for i in range(s.n)]
            )
            for p, s in zip(prompts, params)
        ]
        seqs = [c for s in firsts for c in (s, *s.forks)]  # the engine empties ``forks`` as it forks them
        for s in firsts:
            self.engine.add(s)
        with tqdm(total=len(seqs), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_work():
                bar.update(len(self.engine.step()))
        return [self._output(s) for s in seqs]

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling: SamplingParams | None = None,
        use_tqdm: bool = False,
        tools: Seq[dict] | None = None,
        chat_template: str | None = None,
        lora_request: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template (or ``chat_template``) to one conversation or a list of them, then
        generate. ``tools`` (OpenAI's form) go to the template, as Hugging Face's ``apply_chat_template`` passes
        them; the reply's calls are in its text (``dualpath.serving.tools.ToolCallSplitter`` finds them)."""
        if not self.tokenizer.takes_text:
            self.tokenizer.refuse("a chat (its template renders text)", "messages")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        extra = {"tools": list(tools)} if tools else {}
        tok = self.tokenizer.with_chat_template(chat_template) if chat_template is not None else self.tokenizer
        return self.generate([tok.apply_chat_template(c, **extra) for c in convs], sampling, use_tqdm, lora_request)

    def _output(self, s: Sequence) -> RequestOutput:
        text = (
            s.stop_text
            if s.stop_text is not None
            else self.tokenizer.decode(s.output_ids, s.params.skip_special_tokens)
        )
        lps = s.logprobs if s.params.logprobs is not None else None
        plps = [None, *s.prompt_logprobs] if s.params.prompt_logprobs is not None else None
        return RequestOutput(s.prompt_ids, list(s.output_ids), text, s.finish_reason.value, lps, plps, s.index)

    @torch.inference_mode()
    def logits(self, prompt: str | Seq[int], lora_request: str | None = None) -> torch.Tensor:
        """Logits of every position of one prompt in a single forward (float32), for checks and scoring."""
        from dualpath.engines.models.base import ForwardBatch

        ids = self._prompt_ids(prompt)
        batch = ForwardBatch((0,), (len(ids),), (self._adapter(lora_request),))
        return self.ranks.run(forward_whole, batch, np.asarray(ids, dtype=np.int64))

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (a TP 1 one holds nothing to stop)."""
        self.ranks.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
