"""Finished choices as OpenAI's response bodies (a response that is not streamed): the chat's ``message`` (thinking
and tool calls split out) or the completion's ``text`` (``echo`` first), logprobs in each form, ``best_of``'s best,
and the usage, which the streamed form shares (``dualpath.serving.streaming``)."""

from __future__ import annotations

import time

from dualpath.serving.choices import Outcome, Prompt, best
from dualpath.serving.logprob_forms import check_prompt_logprobs, wants_logprobs


class Replies:
    def __init__(self, front):
        self.front = front

    def body(self, job, got: tuple[list, list, list, list]) -> dict:
        """The whole response's body of ``job`` (``dualpath.serving.pipeline.Job``) from its gathered choices (text
        pieces, logprobs, token ids, outcomes: ``Generations.gather``)."""
        req, kind, prompts = job.req, job.kind, job.prompts
        texts, lps, ids, outcomes = got
        every = outcomes  # usage counts best_of's unreturned candidates too
        texts, lps, outcomes, ids = best(req.n, req.samples(), texts, lps, outcomes, ids)
        choices = [
            self._choice(req, kind, i, t, lp, o, prompts[i // req.n])
            for i, (t, lp, o) in enumerate(zip(texts, lps, outcomes))
        ]
        body = {
            "id": job.rid,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.front.models.reply_name(req.model),
            "choices": choices,
            "usage": self.usage(req, prompts, every),
        }
        if req.return_token_ids:  # vLLM's places: a chat's prompt at the top, a completion's in each choice
            for i, c in enumerate(choices):
                c["token_ids"] = ids[i]
                if kind != "chat":
                    c["prompt_token_ids"] = prompts[i // req.n].ids
            if kind == "chat":
                body["prompt_token_ids"] = prompts[0].ids
        if kind == "chat" and req.prompt_logprobs is not None:  # vLLM's place for it in a chat response
            body["prompt_logprobs"] = self.front.logprobs.prompt(
                prompts[0].ids, outcomes[0].prompt_logprobs, req.prompt_logprobs
            )
        return body

    def _choice(
        self, req, kind: str, index: int, pieces: list[str], lps: list, outcome: Outcome, prompt: Prompt
    ) -> dict:
        """One finished choice (``pieces``: its text, a piece per token)."""
        content = "".join(pieces)
        lps = lps if wants_logprobs(req, kind) else None
        if kind != "chat":
            return self._completion_choice(req, index, content, lps, outcome, prompt)
        message, finish = {"role": "assistant", "content": content, "refusal": None}, outcome.finish_reason
        reasoner = self.front.splits.reasoner(kind, prompt)
        if reasoner is not None:
            split = [reasoner.feed(piece) for piece in pieces] + [reasoner.finish()]
            thought, content = "".join(r for r, _ in split), "".join(a for _, a in split)
            message["content"], message["reasoning_content"] = content, thought or None
            outcome.reasoning_tokens = reasoner.tokens
        splitter = self.front.splits.splitter(req, kind)
        if splitter is not None:
            content = splitter.feed(content) + splitter.finish()
            if splitter.calls:
                outcome.tool_calls = True
                message.update(content=content if content.strip() else None, tool_calls=splitter.calls)
                finish = "tool_calls" if splitter.whole else finish
        return {
            "index": index,
            "message": message,
            "finish_reason": finish,
            "logprobs": self.front.logprobs.chat(lps, req.return_tokens_as_token_ids) if lps is not None else None,
        }

    def _completion_choice(
        self, req, index: int, content: str, lps: list | None, outcome: Outcome, prompt: Prompt
    ) -> dict:
        """A completions choice; with ``echo`` the prompt's text comes first (and, with logprobs, its tokens: the
        first without a logprob, as OpenAI's legacy form has it)."""
        forms, as_ids = self.front.logprobs, req.return_tokens_as_token_ids
        choice = {"index": index, "text": content, "finish_reason": outcome.finish_reason, "logprobs": None}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = forms.prompt(prompt.ids, outcome.prompt_logprobs, req.prompt_logprobs)
        if not req.echo:
            choice["logprobs"] = forms.completion(lps, as_ids=as_ids)[0] if lps is not None else None
            return choice
        head, body = self.echoed(req, prompt, outcome.prompt_logprobs)
        choice["text"] = head + content
        if lps is not None:
            tail, _ = forms.completion(lps, offset0=len(head), as_ids=as_ids)
            choice["logprobs"] = {key: body[key] + tail[key] for key in body}
        return choice

    def echoed(self, req, prompt: Prompt, prompt_lps: list | None) -> tuple[str, dict | None]:
        """``echo``'s head: the prompt's text and, with ``logprobs``, its tokens' logprobs in the legacy form (the
        first token without one)."""
        head = prompt.text if prompt.text is not None else self.front.tokenizer.decode(prompt.ids)
        if req.logprobs is None:
            return head, None
        check_prompt_logprobs(prompt.ids, prompt_lps)
        first = {"token_id": prompt.ids[0], "logprob": None, "top": ()}
        body, _ = self.front.logprobs.completion(
            [first] + [{**lp, "top": lp["top"][: req.logprobs]} for lp in prompt_lps],
            as_ids=req.return_tokens_as_token_ids,
        )
        body["top_logprobs"][0] = None
        return head, body

    @staticmethod
    def usage(req, prompts: list[Prompt], outcomes: list[Outcome]) -> dict:
        """Each prompt counted once, every sampled choice's completion tokens (``best_of``'s unreturned ones too);
        the cache hit and KV bytes loaded of each prompt (once for its choices: ``outcomes`` are in choice order, a
        prompt's together), the read path of the first."""
        firsts = outcomes[:: req.samples()]
        n_prompt, done = sum(len(p.ids) for p in prompts), sum(o.completion_tokens for o in outcomes)
        cached = sum(o.cached_tokens for o in firsts)
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": done,
            "total_tokens": n_prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if thinking := sum(o.reasoning_tokens for o in outcomes):
            usage["completion_tokens_details"] = {"reasoning_tokens": thinking}
        if req.dualpath and req.dualpath.usage:
            usage["dualpath"] = {
                "read_path": firsts[0].path,
                "kv_bytes_loaded": sum(o.storage_bytes for o in firsts),
                "cached_tokens": cached,
            }
        return usage
