"""The prefill engine: layerwise prefill of batches whose hit KV arrives layer by layer.

For each assigned request it (1) loads its PE-side hit blocks from storage into its DRAM buffer and asks the
decode engine to hold buffer slots (and, DE path, to load the DE-side hit blocks); then (2) prefills it in a
FIFO batch formed under the compute quota. Per layer: the layer's cached KV is fetched into a workspace slot —
copied from this engine's buffer (PE side) or read from the decode engine's buffer (DE side) — while the previous
layer computes; after the layer computes, the tokens the decode engine lacks are written into its buffer (PE
path: the whole prompt; DE path: the miss tokens only). The workspace holds two layers: only one layer's KV of the
batch is resident while another arrives. ``basic`` mode (the paper's baseline) fetches every layer before
computing and sends everything after.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dualpath.core.errors import ConfigError, DualPathError, RequestError, StorageError
from dualpath.core.faults import failpoint
from dualpath.core.geometry import LAYERWISE_RESIDENT_LAYERS, FullBlockSlots, KVGeometry, LayerMajorBlocks
from dualpath.core.messages import (
    Assignment,
    PrefillDone,
    PrepareRequest,
    ReadPath,
    RequestRef,
    Role,
    unpack_keys,
    unpack_tokens,
)
from dualpath.core.rpc import ENGINE_METHODS, Client
from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.batcher import CostModel, Pending, form_batch
from dualpath.engines.engine import Engine
from dualpath.engines.guided import Guide
from dualpath.engines.layer_copies import LayerCopies
from dualpath.engines.models.base import ForwardBatch
from dualpath.engines.prefill_jobs import PrefillJobs
from dualpath.engines.sampler import TokenHistory, check_token_ids, extend_prompt_logprobs, make_generator, sample
from dualpath.engines.parallel.steps import LayerHooks, alloc_workspace, logits_of, prefill_layers, time_forward
from dualpath.traffic.manager import AllOf, FutureHandle, LayerPipeline, PeerRegion
from dualpath.traffic.transport.base import Op, RegionDesc

log = logging.getLogger(__name__)


def resident_layers(g: KVGeometry, layerwise: bool) -> int:
    """Layers of a prefill batch's KV in device memory at once: two for layerwise prefill, every one for basic."""
    return LAYERWISE_RESIDENT_LAYERS if layerwise else g.num_layers


def workspace_blocks(g: KVGeometry, workspace_tokens: int, budget_bytes: int, layerwise: bool) -> int:
    """Blocks per layer slot of a prefill workspace: ``workspace_tokens`` worth, fewer where ``budget_bytes`` (0: no
    budget) cannot keep that many resident over ``resident_layers`` (0: not one block of them fits). Under one
    budget a basic batch holds ~num_layers / 2 times fewer tokens (the paper's §2 reason for layerwise prefill)."""
    blocks = max(1, workspace_tokens // g.block_size)
    return min(blocks, g.budget_blocks(budget_bytes, resident_layers(g, layerwise))) if budget_bytes else blocks


@dataclass
class Job:
    a: Assignment
    params: SamplingParams
    generators: list[torch.Generator | None]  # one per choice
    pe_blocks: int  # leading hit blocks this engine reads from storage
    token_ids: list[int] = field(default_factory=list)
    hit_keys: list[bytes] = field(default_factory=list)
    pe_slots: list[int] = field(default_factory=list)  # this engine's buffer slots (block j of the prompt)
    de_slots: list[int] = field(default_factory=list)  # the decode engine's buffer slots (block j)
    computed: int = 0  # leading prompt tokens with KV (hit, then finished chunks)
    local_tokens: int = 0  # leading tokens whose KV is in this engine's buffer
    head_sent: bool = False  # PE-side hit blocks written to the decode engine
    hit_tokens: int = 0  # leading prompt tokens whose stored KV loaded intact
    storage_bytes: int = 0
    layer_loads: list = field(default_factory=list)  # per layer: the storage read of the PE-side hit blocks
    guide: Guide | None = None  # structured output: which first tokens are allowed
    prompt_lps: list = field(default_factory=list)  # prompt logprobs so far (asked for: of tokens 1..)

    @property
    def n_prompt(self) -> int:
        return len(self.token_ids)

    @property
    def work_id(self) -> str:
        return self.a.request_id

    def history(self) -> TokenHistory | None:
        """What the penalties and ``min_tokens`` read for its first tokens (a resumed reply's tokens as reply)."""
        prompt, resumed = self.params.split_resumed(self.token_ids)
        return TokenHistory.of(prompt, self.params, resumed)

    @property
    def loaded(self) -> bool:
        """Its PE-side hit is in this engine's buffer (a batch with it will not wait on storage)."""
        return self.head_sent or all(f.done() for f in self.layer_loads)


class AfterLoad:
    """Wait for a storage read, then run a local copy (in the waiting thread): a layer of hit KV that must land
    in this engine's buffer before it moves on to the device."""

    def __init__(self, load: FutureHandle, then):
        self.load, self.then, self._done = load, then, False

    def wait(self, timeout: float | None = None) -> None:
        self.load.wait(timeout)  # raises the first missing or corrupt block
        if not self._done:
            self._done = True
            self.then()

    def add_done_callback(self, fn) -> None:
        self.load.add_done_callback(fn)


@dataclass
class Workspace:
    """A batch's KV, ``[slots, blocks, block_size, kv_elems]``, as the transport addresses it; layer l uses slot
    l % slots. One device's: its device memory. A tensor-parallel engine's: canonical host staging its ranks map,
    each copying its heads to and from its own device workspace ``key`` (``dualpath.engines.parallel.steps``)."""

    tensor: torch.Tensor
    region: int
    layout: LayerMajorBlocks
    key: str

    @property
    def slots(self) -> int:
        return self.tensor.shape[0]

    @property
    def blocks(self) -> int:
        return self.tensor.shape[1]


class PrefillHooks(LayerHooks):
    """Rank 0's part of each layer of a prefill batch: wait for the layer's KV to be in the workspace before it
    computes, start sending it once computed (``LayerPipeline``)."""

    def __init__(self, engine: "PrefillEngine", pipe: LayerPipeline, basic: bool):
        self.copies, self.pipe, self.basic, self.layers = engine.copies, pipe, basic, engine.geometry.num_layers

    def begin(self) -> None:
        self.pipe.begin()
        if self.basic:  # the baseline: the whole batch's KV is resident before the first layer computes
            for layer in range(self.layers):
                self.pipe.wait_layer(layer)

    def before(self, layer: int) -> None:
        if layer == self.layers // 2:
            failpoint("prefill.prefilling")
        if not self.basic:
            self.pipe.wait_layer(layer)
        self.copies.before_compute(layer)

    def after(self, layer: int, slot: int) -> None:
        # the send reads this layer's KV once its kernels have run: the pipeline's sender thread waits for that,
        # this thread goes on launching the next layer
        computed = self.copies.after_compute(slot)
        self.pipe.layer_done(layer, None if self.basic else computed)


class PrefillEngine(Engine):
    role = Role.PREFILL

    def setup(self) -> None:
        g = self.geometry
        self.stages: list = []  # tensor parallelism: the workspaces' shared host staging (closed at the end)
        self.workspace = self._workspace(layerwise=True)
        self.copies = LayerCopies(self.device)  # hit KV host -> device on its own stream (CUDA)
        self.basic_workspace: Workspace | None = None  # all layers resident: allocated on first basic batch
        self.jobs: PrefillJobs[Job] = PrefillJobs()  # the only place jobs are added, queued, cancelled, removed
        self.de_clients: dict[str, Client] = {}
        self.de_peers: dict[str, str] = {}  # decode engine -> the transport address we added it with
        self.de_lock = threading.Lock()  # assignments are prepared on threads of their own: one adds a new peer
        self.cost = CostModel(*self.cfg.cost_model) if self.cfg.cost_model else self.profile()
        log.info("prefill cost model: %s (quota %.0f ms)", self.cost, 1000 * self.cfg.compute_quota_s)
        assert g.block_size > 0

    def _blocks(self, layerwise: bool) -> int:
        return workspace_blocks(self.geometry, self.cfg.workspace_tokens, self.cfg.prefill_kv_budget_bytes, layerwise)

    def _workspace(self, layerwise: bool, key: str = "ws") -> Workspace:
        g = self.geometry
        slots, blocks = resident_layers(g, layerwise), self._blocks(layerwise)
        if blocks < 1:
            raise ConfigError(
                f"a prefill KV budget of {self.cfg.prefill_kv_budget_bytes} bytes holds no block of {slots} layers "
                f"({slots} x {g.layer_block_bytes} bytes)"
            )
        if self.ranks.size == 1:
            t = self.ranks.run(alloc_workspace, key, g, slots, blocks, None)
            return Workspace(
                t, self.transport.register(t).region_id, LayerMajorBlocks(g, blocks, num_layers=slots), key
            )
        stage = self._host_memory(slots * blocks * g.layer_block_bytes)
        self.stages.append(stage)
        region = self.transport.register(stage).region_id
        self.ranks.run(alloc_workspace, key, g, slots, blocks, (stage.name, stage.nbytes))
        return Workspace(self.ranks.state.host[key], region, LayerMajorBlocks(g, blocks, num_layers=slots), key)

    def capacity_tokens(self) -> int:
        return self.workspace.blocks * self.geometry.block_size

    def held(self) -> dict[str, int]:
        """Work ids -> tokens still to compute (the prefill load the scheduler balances)."""
        return {j.work_id: j.n_prompt - max(j.computed, j.hit_tokens) for j in self.jobs.live()}

    def admission_lock(self) -> threading.Condition:
        return self.jobs.cond

    def beta_tokens(self) -> int:
        """Tokens this device prefills in 5 s, by the cost model (attention over cached tokens left out)."""
        if self.cfg.beta_tokens:
            return self.cfg.beta_tokens
        return self.cost.tokens_in(5.0)

    # --- start-up profile -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def profile(self, repeat_under_s: float = 1.0) -> CostModel:
        """Time a few forwards of synthetic (cached, new) shapes and fit the batcher's cost model. A warm-up forward
        first (first-call allocations and kernel compiles are no batch's cost); each shape is timed again, the
        faster time kept, only when one pass took under ``repeat_under_s``: on a GPU the pass takes milliseconds,
        on a CPU seconds (SmolLM2: 5 s), which a second pass would add to every prefill engine's start."""
        cap = self.capacity_tokens()
        shapes = [[(0, 32)], [(0, 128)], [(0, 256)], [(256, 64)], [(512, 128)], [(0, 64)] * 4]
        shapes = [[(min(c, cap // 2), min(n, cap // 2)) for c, n in items] for items in shapes]
        self._time_forward(shapes[0])
        times = [self._time_forward(items) for items in shapes]
        if sum(times) < repeat_under_s:
            times = [min(t, self._time_forward(items)) for t, items in zip(times, shapes)]
        return CostModel.fit(list(zip(shapes, times)))

    def _time_forward(self, items) -> float:
        return self.ranks.run(time_forward, self.geometry, items)

    # --- assignments ----------------------------------------------------------------------------------------
    def on_assignment(self, a: Assignment) -> None:
        failpoint("prefill.queued")
        params = SamplingParams.from_dict(a.sampling)
        if not self.guides_ready(params, lambda: self.on_assignment(a)):
            return
        keys = unpack_keys(a.hit_keys)
        pe_blocks = len(keys) if a.path is ReadPath.PE else max(0, a.split_pe_blocks)
        gens = [make_generator(params, i) for i in range(params.n)]
        job = Job(
            a, params, gens, pe_blocks, unpack_tokens(a.tokens), keys, hit_tokens=len(keys) * self.geometry.block_size
        )
        try:
            check_token_ids(params, self.model_config.vocab_size, job.token_ids)
            self.model.check_adapter(params.adapter)
            if params.prompt_logprobs is not None and a.num_hit_blocks:
                raise RequestError("prompt_logprobs needs the whole prompt computed, not loaded")
            self._check_fits(job)
        except RequestError as e:
            self._fail(job, str(e))
            return
        try:
            job.guide = self.guides.guide_for(params, params.split_resumed(job.token_ids)[1])
        except DualPathError as e:  # this checkpoint's tokenizer cannot be masked: the request fails, clearly
            self._fail(job, f"structured output: {e}")
            return
        if not self.jobs.admit(job, lambda: not self.updating):
            self._fail(job, "the prefill engine is loading new weights" if self.updating else "already held")
            return
        threading.Thread(target=self._prepare, args=(job,), daemon=True, name=f"prep-{a.request_id}").start()

    def _check_fits(self, job: Job) -> None:
        """A prompt whose KV cannot be resident at once (its last chunk attends over all of it) fails now, clearly:
        queued, it would never fit a batch."""
        g, layers = self.geometry, resident_layers(self.geometry, job.a.layerwise)
        cap = self._blocks(job.a.layerwise)
        if g.num_blocks(job.n_prompt) > cap:
            mode = "layerwise" if job.a.layerwise else "basic (non-layerwise)"
            raise RequestError(
                f"a {job.n_prompt}-token prompt's KV over {layers} resident layers "
                f"({g.num_blocks(job.n_prompt) * layers * g.layer_block_bytes} bytes) does not fit this prefill "
                f"engine's {mode} workspace of {cap * g.block_size} tokens (--workspace-tokens "
                f"{self.cfg.workspace_tokens}, --prefill-kv-budget {self.cfg.prefill_kv_budget_bytes}); "
                "raise them or prefill layerwise"
            )

    def _de(self, a: Assignment) -> Client:
        de = a.decode
        with self.de_lock:
            if self.de_peers.get(de.engine_id) != repr(de.transport_address):
                regions = [RegionDesc.from_dict(r) for r in de.regions]
                self.transport.add_peer(de.engine_id, de.transport_address, regions)
                self.de_peers[de.engine_id] = repr(de.transport_address)
                self.de_clients[de.engine_id] = Client("Engine", ENGINE_METHODS, de.control_address)
            return self.de_clients[de.engine_id]

    def _prepare(self, job: Job) -> None:
        """Load this side's hit blocks and have the decode engine hold slots (and load its side) in parallel."""
        a, g = job.a, self.geometry
        try:
            nb = g.num_blocks(job.n_prompt)
            # PE path keeps every computed chunk locally, so the buffer holds the whole prompt; while the buffer is
            # full of the work ahead, this request waits its turn (it counts in this engine's load meanwhile)
            want = nb if a.path is ReadPath.PE else job.pe_blocks
            job.pe_slots = (
                self.buffer.allocate_while_moving(
                    want,
                    a.request_id,
                    self.cfg.transport.op_timeout_s,
                    lambda: not self.stopping.is_set() and not self.jobs.cancelled(job.work_id),
                )
                if want
                else []
            )
            keys = job.hit_keys[: job.pe_blocks]
            if keys:  # layer by layer: the prefill may start once layer 0 is in
                job.layer_loads = self.traffic.load_layers(keys, job.pe_slots[: job.pe_blocks])
                failpoint("prefill.loading")
            reply = self._de(a).call(
                "Prepare",
                PrepareRequest(
                    a.request_id,
                    job.n_prompt,
                    job.pe_blocks,
                    b"".join(job.hit_keys[job.pe_blocks :]),
                    job.params.max_new_tokens,
                    job.params.n,
                ),
                timeout=self.cfg.transport.op_timeout_s * 4,
            )
            if not reply.ok:
                raise DualPathError(f"decode engine {a.decode.engine_id} refused: {reply.error}")
            job.de_slots = reply.slots
        except Exception as e:  # noqa: BLE001 - any failure here fails the request, not the engine
            self._fail(job, f"preparing failed: {e}")
            return
        # PE-side blocks count as intact until one of their layer reads says otherwise (then ``_restart``)
        self._set_hit(job, job.pe_blocks + reply.num_loaded_blocks)
        job.storage_bytes = (job.pe_blocks + reply.num_loaded_blocks) * g.full_block_bytes
        if not self.jobs.requeue(job):
            self._release(job, "cancelled while preparing")

    def _set_hit(self, job: Job, hit_blocks: int) -> None:
        """The request's usable hit: ``hit_blocks`` leading blocks; the rest is recomputed (and counted)."""
        g, a = self.geometry, job.a
        lost = job.hit_tokens // g.block_size - hit_blocks
        if lost > 0:
            self.kv_load_failures += lost
            log.warning(
                "%s: %d stored blocks missing or corrupt; recomputing from block %d", a.request_id, lost, hit_blocks
            )
        job.pe_blocks = min(job.pe_blocks, hit_blocks)
        job.computed = job.hit_tokens = hit_blocks * g.block_size
        job.local_tokens = job.computed if a.path is ReadPath.PE else job.pe_blocks * g.block_size

    def _restart(self, job: Job) -> None:
        """A PE-side block failed to load mid-prefill: shorten the hit to before it and prefill again."""
        first_bad = job.pe_blocks
        for fut in job.layer_loads:
            results = fut.result(self.cfg.transport.op_timeout_s * 4)
            first_bad = min(first_bad, next((i for i, e in enumerate(results) if e is not None), first_bad))
        self._set_hit(job, first_bad)
        job.layer_loads = []
        job.head_sent = False

    def _fail(self, job: Job, reason: str) -> None:
        """End a job the caller holds (a step's, or one never admitted): the scheduler hears it failed, unless it was
        cancelled meanwhile (then the scheduler already dropped it)."""
        if self.jobs.finish(job):
            reason = f"cancelled ({reason})"
        else:
            log.warning("%s failed: %s", job.work_id, reason)
            self.outbox.add("failed", [job.work_id, reason])
            self.report_soon()
        self._release(job, reason)

    def _release(self, job: Job, reason: str) -> None:
        """Give back what an ended job holds here, then tell its decode engine nothing of it is in flight (it keeps
        the job's buffer slots until then). Slots return only once no storage read can still land in them: a late
        read would overwrite the KV of the request that takes them next."""
        if self._loads_settled(job):
            self.buffer.free_owner(job.work_id)
        client = self.de_clients.get(job.a.decode.engine_id)
        if client is not None:
            try:
                client.call("Release", RequestRef(job.work_id, reason), timeout=5)
            except DualPathError:
                pass  # the decode engine's own cancel, or its restart, frees the reservation

    def _loads_settled(self, job: Job) -> bool:
        timeout = self.cfg.transport.op_timeout_s * 4
        for fut in job.layer_loads:
            try:
                fut.result(timeout)
            except TimeoutError:
                log.error(
                    "%s: a storage read into its buffer slots did not end in %.0f s; the slots stay out of use",
                    job.work_id,
                    timeout,
                )
                return False
            except Exception:  # noqa: BLE001 - a failed read is settled too
                pass
        return True

    def on_cancel(self, work_id: str, reason: str) -> None:
        job = self.jobs.cancel(work_id)  # None when a step holds it: that step releases it
        if job is not None:  # (off the pull thread: the decode engine's answer may take a while)
            threading.Thread(target=self._release, args=(job, reason), daemon=True, name=f"cancel-{work_id}").start()

    # --- batches --------------------------------------------------------------------------------------------
    def loop(self) -> None:
        # data-parallel attention: a turn without a batch serves the group's forwards (``dualpath.engines.parallel.dp``);
        # while the group computes it does not wait for work at all (the others' next forward waits on this turn)
        served = False
        while not self.stopping.is_set():
            jobs = self.jobs.take(self._choose, self.stopping, 0.0 if served else 0.02 if self.dp else 0.1)
            if jobs:
                basic = not jobs[0][0].a.layerwise
                self._run(jobs, self._basic_workspace() if basic else self.workspace, basic)
            elif self.dp is not None:
                served = self.dp.idle()

    def _choose(self, ready: list[Job]) -> list[tuple[Job, int]]:
        """The next batch of ready jobs (each with its tokens to compute now), by the cost model under the quota."""
        order = self._batchable(ready)
        basic = not order[0].a.layerwise
        ws = self._basic_workspace() if basic else self.workspace
        by_id = {j.work_id: j for j in order}
        batch = form_batch(
            [Pending(j.work_id, j.computed, j.n_prompt - j.computed) for j in order],
            self.cost,
            self.cfg.compute_quota_s,
            self.geometry.block_size,
            max_blocks=ws.blocks,
        )
        return [(by_id[w], n) for w, n in batch]

    @staticmethod
    def _batchable(ready: list[Job]) -> list[Job]:
        """Ready work whose hit is loaded, so storage never stalls the compute of loaded work; when none is
        loaded, the head alone, so an idle engine starts it layer by layer as its hit arrives. Most urgent first
        (``SamplingParams.priority``; the sort is stable, so arrival order within a priority, and all of it under
        first come, first served): work the scheduler handed over ahead of an urgent request waits behind it."""
        ready = sorted(ready, key=lambda j: j.params.priority)
        loaded = [j for j in ready if j.loaded]
        return loaded or ready[:1]

    def _basic_workspace(self) -> Workspace:
        if self.basic_workspace is None:
            self.basic_workspace = self._workspace(False, "basic")
        return self.basic_workspace

    def stop(self) -> None:
        super().stop()
        for stage in self.stages:
            stage.close()

    def _run(self, jobs: list[tuple[Job, int]], ws: Workspace, basic: bool) -> None:
        try:
            finals = self._prefill(jobs, ws, basic)
        except StorageError as e:  # a stored block failed its read mid-prefill: recompute it, redo the batch
            log.warning("prefill batch redone: %s", e)
            for job, _ in jobs:
                if any(f.done() and any(r is not None for r in f.result()) for f in job.layer_loads):
                    self._restart(job)
            for job, _ in reversed(jobs):
                self._requeue(job)
            return
        except Exception as e:  # noqa: BLE001 - the batch fails, the engine goes on
            log.exception("prefill batch failed")
            for job, _ in jobs:
                self._fail(job, f"prefill failed: {e}")
            return
        for job, n in jobs:
            job.head_sent = True
            job.computed += n
            if job.a.path is ReadPath.PE:
                job.local_tokens = job.computed
        for job, _ in reversed(jobs):
            if job.computed < job.n_prompt:
                self._requeue(job)
        self._hand_off(finals)

    def _requeue(self, job: Job) -> None:
        """Put a job a batch ran back at the head of the ready list: its next chunk, or the batch redone."""
        if not self.jobs.requeue(job, front=True):
            self._release(job, "cancelled during its prefill")

    @torch.inference_mode()
    def _prefill(self, jobs: list[tuple[Job, int]], ws: Workspace, basic: bool) -> list[tuple[Job, torch.Tensor]]:
        g = self.geometry
        cached = [j.computed for j, _ in jobs]
        new = [n for _, n in jobs]
        bases, base = [], 0
        for c, n in zip(cached, new):
            bases.append(base)
            base += g.num_blocks(c + n)
        batch = ForwardBatch(tuple(cached), tuple(new), tuple(j.params.adapter for j, _ in jobs))
        ids = np.concatenate([np.asarray(j.token_ids[c : c + n], dtype=np.int64) for (j, n), c in zip(jobs, cached)])
        # each new token's flat slot in a workspace layer: sequence i's tokens fill the blocks from bases[i] on
        slots = np.repeat(np.asarray(bases) * g.block_size, new) + batch.positions()
        counts = [g.num_blocks(c + n) for c, n in zip(cached, new)]

        fetch = lambda layer: AllOf(
            [
                self._fetch(j, cached[i], bases[i], layer, ws)  # noqa: E731
                for i, (j, _) in enumerate(jobs)
            ]
        )
        send = lambda layer: AllOf(
            [
                self._send(j, cached[i], new[i], bases[i], layer, ws)  # noqa: E731
                for i, (j, _) in enumerate(jobs)
            ]
        )
        timeout = self.cfg.transport.op_timeout_s * 2
        if basic:
            pipe = LayerPipeline(g.num_layers, fetch, lambda layer: None, depth=g.num_layers - 1, timeout=timeout)
        else:
            pipe = LayerPipeline(g.num_layers, fetch, send, depth=1, timeout=timeout)
        t0 = time.perf_counter()
        try:
            hidden = self.ranks.run(
                prefill_layers, g, batch, ids, slots, bases, counts, ws.key, hooks=PrefillHooks(self, pipe, basic)
            )
        except BaseException:
            pipe.abandon()
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.busy_s += time.perf_counter() - t0 - pipe.wait_time
        self.busy_tokens += sum(new)
        pipe.finish()
        if basic:  # the baseline sends everything after computing everything
            AllOf([send(layer) for layer in range(g.num_layers)]).wait(timeout)
        last = batch.last_token_indices()
        for i, (j, n) in enumerate(jobs):  # the scheduler gives these no hit: chunks come from position 0
            if j.params.prompt_logprobs is not None:
                extend_prompt_logprobs(
                    j.prompt_lps,
                    j.token_ids,
                    cached[i],
                    hidden[last[i] - n + 1 : last[i] + 1],
                    self._logits,
                    j.params.prompt_logprobs,
                )
        finals = [(j, i) for i, (j, n) in enumerate(jobs) if cached[i] + n == j.n_prompt]
        if not finals:
            return []
        logits = self._logits(hidden[[last[i] for _, i in finals]])
        return [(j, logits[k]) for k, (j, _) in enumerate(finals)]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden-state rows (on every rank: the rows travel with the step)."""
        return self.ranks.run(logits_of, hidden.cpu() if self.ranks.size > 1 else hidden)

    def _fetch(self, job: Job, cached: int, base: int, layer: int, ws: Workspace):
        """Bring tokens [0, cached) of ``layer`` into the workspace: the local prefix from this engine's
        buffer, the rest from the decode engine's buffer."""
        g = self.geometry
        local = min(job.local_tokens, cached)
        handles = []
        if local:
            k = g.num_blocks(local)
            out = ws.tensor[layer % ws.slots, base : base + k].reshape(-1, g.kv_elems_per_token)
            copy = (
                lambda: self.copies.issue(  # noqa: E731
                    layer,
                    layer % ws.slots,
                    lambda stream: self.traffic.layer_to_device(job.pe_slots[:k], layer, out, stream),
                )
            )
            if job.layer_loads and not job.head_sent:  # this layer of the hit may still be on its way from storage
                handles.append(AfterLoad(FutureHandle(job.layer_loads[layer]), copy))
            else:
                copy()
        if cached > local:
            j0, j1 = local // g.block_size, g.num_blocks(cached)
            handles.append(
                self.traffic.move_layers(
                    Op.READ,
                    ws.region,
                    ws.layout,
                    list(range(base + j0, base + j1)),
                    self._de_region(job),
                    job.de_slots[j0:j1],
                    [layer],
                    (local - j0 * g.block_size, cached - j0 * g.block_size),
                    path="de_read",
                )
            )
        return AllOf(handles)

    def _send(self, job: Job, cached: int, n: int, base: int, layer: int, ws: Workspace):
        """Write what the decode engine lacks of ``layer``: the PE-side hit blocks (first chunk) and this chunk."""
        g = self.geometry
        ranges = []
        if not job.head_sent and job.pe_blocks:
            ranges.append((0, job.pe_blocks * g.block_size))
        if ranges and ranges[-1][1] == cached:
            ranges[-1] = (ranges[-1][0], cached + n)
        else:
            ranges.append((cached, cached + n))
        handles = []
        for t0, t1 in ranges:
            j0, j1 = t0 // g.block_size, g.num_blocks(t1)
            handles.append(
                self.traffic.move_layers(
                    Op.WRITE,
                    ws.region,
                    ws.layout,
                    list(range(base + j0, base + j1)),
                    self._de_region(job),
                    job.de_slots[j0:j1],
                    [layer],
                    (t0 - j0 * g.block_size, t1 - j0 * g.block_size),
                    path="p2d",
                )
            )
        if job.a.path is ReadPath.PE and cached + n < job.n_prompt:
            # a chunk in the middle of the prompt: keep its KV here too, for the next chunk's fetch
            j0, j1 = cached // g.block_size, (cached + n) // g.block_size
            src = ws.tensor[layer % ws.slots, base + j0 : base + j1].reshape(-1, g.kv_elems_per_token)
            self.traffic.layer_from_device(job.pe_slots[j0:j1], layer, src)
        return AllOf(handles)

    def _de_region(self, job: Job) -> PeerRegion:
        de = job.a.decode
        return PeerRegion(de.engine_id, de.buffer_region, FullBlockSlots(self.geometry, de.buffer_slots))

    def _hand_off(self, finals: list[tuple[Job, torch.Tensor]]) -> None:
        """Sample each finished prompt's first tokens (one per choice, from its one row of logits) and tell its
        decode engine the KV is in place."""
        if not finals:
            return
        rows = [(j, lg) for j, lg in finals for _ in range(j.params.n)]
        jobs = [j for j, _ in rows]
        gens = [g for j, _ in finals for g in j.generators]
        masks = {j.work_id: j.guide.mask() if j.guide else None for j, _ in finals}
        history = {j.work_id: j.history() for j, _ in finals}  # read, never grown here
        tokens, logprobs = sample(
            torch.stack([lg for _, lg in rows]),
            [j.params for j in jobs],
            gens,
            [masks[j.work_id] for j in jobs],
            [history[j.work_id] for j in jobs],
            self.model_config.eos_token_ids,
        )
        start = 0
        for job, _ in finals:
            n = job.params.n
            self._send_done(job, tokens[start : start + n], logprobs[start : start + n])
            start += n

    def _send_done(self, job: Job, tokens: list[int], logprobs: list) -> None:
        if self.jobs.cancelled(job.work_id):  # (a cancel during the call: the decode engine refuses the hand-off)
            self._fail(job, "cancelled during its prefill")
            return
        failpoint("prefill.handoff")
        states = [g.get_state().numpy().tobytes().hex() for g in job.generators] if not job.params.greedy else []
        path = "split" if job.a.split_pe_blocks > 0 else job.a.path.value
        msg = PrefillDone(
            job.work_id,
            job.a.tokens,
            dict(job.a.sampling),
            list(tokens),
            [lp.__dict__ if lp is not None else None for lp in logprobs],
            states,
            job.hit_tokens,
            path,
            job.storage_bytes,
            [x.__dict__ for x in job.prompt_lps] if job.params.prompt_logprobs is not None else None,
        )
        try:
            ack = self._de(job.a).call("PrefillDone", msg, timeout=30)
            if not ack.ok:
                raise DualPathError(ack.error)
        except DualPathError as e:
            self._fail(job, f"hand-off to {job.a.decode.engine_id} failed: {e}")
            return
        self.jobs.finish(job)
        self.buffer.free_owner(job.work_id)
