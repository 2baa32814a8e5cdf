"""``dualpath run-batch``: requests in OpenAI's batch input format run through the frontend in-process (the HTTP
server's own request handling: every field, every error), each result appended to the output file in OpenAI's batch
output format as it finishes; an interrupted job run again with the same output skips what it finished.

Input, one request per line (``url``: /v1/chat/completions, /v1/completions or /v1/responses)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": ..., "messages": ...}}

Output, one line per input line, in the order they finish::

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": ..., "body": {...}},
     "error": null}

A request the server answers with an error keeps that answer (its status and OpenAI error body). A line that cannot
be sent (not JSON, no ``custom_id``, a duplicate one, another method or url, ``stream``) has ``response`` null and
``error`` {code, message}: every input line gets exactly one output line. Overloaded answers (429, 503) are retried
until ``retry_s`` has passed; a cluster whose ``/health`` stays unavailable for ``down_s`` ends the job with an error
(what finished is in the output, and a rerun resumes) rather than each request waiting out its retries.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dualpath.core.errors import DualPathError

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass(frozen=True)
class BatchConfig:
    max_concurrency: int = 64  # requests in flight (each of a request's n choices counts at the server)
    retry_s: float = 600.0  # how long an overloaded request (429, 503) is retried before its answer is kept
    down_s: float = 60.0  # how long the cluster may stay unavailable (503 and /health failing) before the job ends
    request_timeout_s: float = 3600.0


@dataclass(frozen=True)
class BatchLine:
    number: int  # 1-based, in the input file
    custom_id: str | None
    url: str = ""
    body: dict | None = None
    error: str = ""  # why the line cannot be sent ("" if it can)

    @property
    def key(self) -> str:
        """What a result is matched to on a resume: a sendable line's custom_id (a line error is checked again)."""
        return f"line {self.number}" if self.error else self.custom_id


def read_batch(path: str | Path) -> list[BatchLine]:
    """Every non-blank input line, checked: a line that cannot be sent carries its error (the first of two lines
    with one custom_id runs, the second is an error)."""
    out, seen = [], set()
    for number, text in enumerate(Path(path).read_text().splitlines(), 1):
        if text.strip():
            line = _parse(number, text)
            if line.custom_id is not None and not line.error and line.custom_id in seen:
                line = BatchLine(number, line.custom_id, error=f"custom_id {line.custom_id!r} is not unique")
            seen.add(line.custom_id)
            out.append(line)
    return out


def _parse(number: int, text: str) -> BatchLine:
    try:
        rec = json.loads(text)
    except ValueError as e:
        return BatchLine(number, None, error=f"line {number} is not valid JSON: {e}")
    if not isinstance(rec, dict) or not isinstance(rec.get("custom_id"), str) or not rec["custom_id"]:
        return BatchLine(number, None, error=f"line {number}: custom_id (a non-empty string) is required")
    cid, url, body = rec["custom_id"], rec.get("url"), rec.get("body")
    unknown = sorted(set(rec) - {"custom_id", "method", "url", "body"})
    problem = (
        f"unknown fields {unknown}"
        if unknown
        else "method must be POST"
        if rec.get("method", "POST") != "POST"
        else f"url must be one of {', '.join(URLS)}"
        if url not in URLS
        else "body must be an object"
        if not isinstance(body, dict)
        else "stream is not supported in a batch"
        if body.get("stream")
        else ""
    )
    return BatchLine(number, cid, url, body, problem and f"line {number}: {problem}")


def finished(out: Path, lines: list[BatchLine]) -> tuple[set[str], list[str]]:
    """The custom_ids ``out`` already holds an answer below 500 for, and those result lines (a server error, a line
    error and a line cut by the interruption are done again). An answer for a custom_id this input does not send
    means ``out`` belongs to another batch: an error, not something to resume from."""
    if not out.exists():
        return set(), []
    sendable, done, kept = {line.custom_id for line in lines if not line.error}, set(), []
    for number, text in enumerate(out.read_text().splitlines(), 1):
        try:
            rec = json.loads(text)
        except ValueError:
            continue
        if rec.get("response") is None:
            continue
        if rec.get("custom_id") not in sendable:
            raise DualPathError(
                f"{out}:{number}: an answer for custom_id {rec.get('custom_id')!r}, which this input "
                f"does not send: the output holds another batch's results; use a new output file"
            )
        if rec["response"]["status_code"] < 500 and rec["custom_id"] not in done:
            done.add(rec["custom_id"])
            kept.append(text)
    return done, kept


class BatchRun:
    """Sends lines to an ASGI app (the frontend's) and writes each result as it comes."""

    def __init__(self, app, cfg: BatchConfig):
        self.app, self.cfg, self.start = app, cfg, time.perf_counter()
        self.down_since: float | None = None  # when the cluster was first found unavailable (None: it is up)
        self.counts = {"succeeded": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0}

    async def run(self, lines: list[BatchLine], out, progress: bool = True) -> None:
        import httpx

        queue: asyncio.Queue = asyncio.Queue()
        for line in lines:
            queue.put_nowait(line)
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)  # a bug answers 500
        async with httpx.AsyncClient(
            transport=transport, base_url="http://batch", timeout=self.cfg.request_timeout_s
        ) as client:
            with tqdm(total=len(lines), disable=not progress, unit="req", desc="batch", smoothing=0.1) as bar:
                workers = [
                    asyncio.create_task(self._worker(client, queue, out, bar))
                    for _ in range(min(self.cfg.max_concurrency, len(lines)) or 1)
                ]
                try:
                    await asyncio.gather(*workers)
                finally:  # one worker's error ends the others (their requests are cancelled as clients that left)
                    for w in workers:
                        w.cancel()
                    await asyncio.gather(*workers, return_exceptions=True)

    async def _worker(self, client, queue: asyncio.Queue, out, bar) -> None:
        while not queue.empty():
            line = queue.get_nowait()
            rec = await self._result(client, line)
            out.write(json.dumps(rec) + "\n")
            out.flush()
            bar.update(1)
            bar.set_postfix(
                ok=self.counts["succeeded"],
                failed=self.counts["failed"],
                tok_s=f"{self.counts['completion_tokens'] / (time.perf_counter() - self.start):.0f}",
                refresh=False,
            )

    async def _result(self, client, line: BatchLine) -> dict[str, Any]:
        rid = f"batch_req_{uuid.uuid4().hex}"
        if line.error:
            self.counts["failed"] += 1
            return {
                "id": rid,
                "custom_id": line.custom_id,
                "line": line.number,
                "response": None,
                "error": {"code": "invalid_request", "message": line.error},
            }
        deadline = time.monotonic() + self.cfg.retry_s
        while True:
            r = await client.post(line.url, json=line.body)
            if r.status_code not in (429, 503) or time.monotonic() >= deadline:
                break
            if r.status_code == 503:
                await self._check_up(client, r)
            await asyncio.sleep(min(float(r.headers.get("retry-after", 1)), max(0.0, deadline - time.monotonic())))
        try:
            body = r.json()
        except ValueError:
            body = {"error": {"message": r.text, "type": "server_error", "param": None, "code": None}}
        self._count(r.status_code, body)
        return {
            "id": rid,
            "custom_id": line.custom_id,
            "line": line.number,
            "response": {"status_code": r.status_code, "request_id": body.get("id", rid), "body": body},
            "error": None,
        }

    async def _check_up(self, client, refused) -> None:
        """Raise once the cluster has been unavailable for ``down_s`` (an overloaded one is up: its /health is ok)."""
        if (await client.get("/health")).status_code == 200:
            self.down_since = None
            return
        now = time.monotonic()
        self.down_since = self.down_since or now
        if now - self.down_since >= self.cfg.down_s:
            raise DualPathError(
                f"the cluster has been unavailable for {now - self.down_since:.0f} s (last answer: "
                f"{refused.text[:200]}); the results so far are in the output, and running the job "
                f"again resumes"
            )

    def _count(self, status: int, body: dict) -> None:
        self.counts["succeeded" if status == 200 else "failed"] += 1
        usage = body.get("usage") or {}
        self.counts["prompt_tokens"] += usage.get("prompt_tokens", usage.get("input_tokens", 0))
        self.counts["completion_tokens"] += usage.get("completion_tokens", usage.get("output_tokens", 0))


def run_batch(
    app, input_path: str | Path, out_path: str | Path, cfg: BatchConfig = BatchConfig(), progress: bool = True
) -> dict:
    """Run every input line not already answered in ``out_path``; the job's summary."""
    lines, out_path = read_batch(input_path), Path(out_path)
    if not lines:
        raise DualPathError(f"{input_path} holds no requests")
    done, kept = finished(out_path, lines)
    out_path.write_text("".join(text + "\n" for text in kept))  # drop what runs again
    todo = [line for line in lines if line.key not in done]
    start = time.perf_counter()
    job = BatchRun(app, cfg)
    with open(out_path, "a") as out:
        asyncio.run(job.run(todo, out, progress))
    elapsed = time.perf_counter() - start
    return {
        "lines": len(lines),
        "already_done": len(lines) - len(todo),
        "run": len(todo),
        **job.counts,
        "elapsed_s": elapsed,
        "completion_tokens_per_s": job.counts["completion_tokens"] / elapsed if elapsed else 0.0,
    }


def batch_main(args) -> int:
    """``dualpath run-batch``: a cluster started here (or ``--scheduler``'s), the frontend in this process."""
    from dualpath.args import resolve_model
    from dualpath.serving.openai_api import Frontend, FrontendConfig
    from dualpath.serving.serve import cluster_from_args, frontend_options, served_names
    from dualpath.engines.models import open_checkpoint

    try:  # an unreadable or empty input fails before a cluster starts
        if not read_batch(args.input):
            raise DualPathError(f"{args.input} holds no requests")
    except OSError as e:
        raise DualPathError(f"cannot read the batch input: {e}") from None
    cluster, options = None, frontend_options(args)
    try:
        if args.scheduler:
            scheduler, model_dir = args.scheduler, resolve_model(args.model)
            max_len = open_checkpoint(model_dir).config.context_limit(args.max_model_len)
        else:
            cluster, model_dir, max_len = cluster_from_args(args)
            scheduler = cluster.scheduler_address
        names = served_names(args, model_dir)
        frontend = Frontend(
            FrontendConfig(
                names[0],
                model_dir,
                scheduler,
                max_len,
                model_aliases=names[1:],
                default_max_tokens=args.default_max_tokens,
                max_stored_responses=0,
                **options,
            )
        )
        summary = run_batch(
            frontend.app,
            args.input,
            args.output,
            BatchConfig(max_concurrency=args.max_concurrency),
            progress=not args.no_progress,
        )
        frontend.client.close()
    finally:
        if cluster is not None:
            cluster.stop()
    print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    print(f"results: {args.output}")
    return 0
