"""The scheduler's block index follows what the store holds once a capped store evicts: a prefill and a decode
engine (tiny model, CPU, real files) serve requests for a real ``SchedulerCore`` in this process; the decode
engine stores each prompt's blocks in a store capped at 8 blocks, so the third prompt's blocks push the first's
out (least recently used first). Every hit the scheduler then computes equals the leading blocks still on disk."""

from dualpath.core.geometry import block_hashes
from dualpath.traffic.storage.fs import header_bytes, list_stored_keys
from engines_on_core import EngineSpec, engines_on_core, running, submit, wait_for

BS = 16
N = 5 * BS + 3  # 5 full blocks stored per request (its reply's few tokens fill no other)
PROMPTS = [[(i * (7 + 2 * p) + p) % 250 + 3 for i in range(N)] for p in range(3)]
CAP_BLOCKS = 8


def test_evicted_blocks_leave_the_index_and_hits_match_the_store(tiny_dirs, tmp_path):
    from dualpath.core.geometry import KVGeometry
    from dualpath.engines.models import open_checkpoint

    geometry = KVGeometry.for_model(open_checkpoint(tiny_dirs["llama"]).config, "float32", BS)
    file_bytes = header_bytes(geometry) + geometry.full_block_bytes
    specs = [
        EngineSpec("prefill", "pe", "n1"),
        EngineSpec("decode", "de", "n2", capacity_bytes=CAP_BLOCKS * file_bytes),
    ]
    with engines_on_core(tiny_dirs["llama"], tmp_path, BS, specs) as (core, engines):
        model_dir = tmp_path / "kv" / engines["de"].fingerprint.hex()
        with running(*engines.values()):
            for i, prompt in enumerate(PROMPTS):  # one after another: the first's blocks are the oldest
                events = submit(core, f"r{i}", prompt, max_tokens=3)
                wait_for(lambda: events and events[-1].kind in ("finished", "failed"), 60, f"r{i} to end")
                assert events[-1].kind == "finished", events
        on_disk = set(list_stored_keys(model_dir))
        assert len(on_disk) <= CAP_BLOCKS and core.counters["blocks_evicted"] >= 3 * 5 - CAP_BLOCKS
        assert core.stats()["index_blocks"] == len(on_disk)
        hits = []
        for i, prompt in enumerate(PROMPTS):
            keys = block_hashes(prompt, engines["de"].fingerprint, BS)
            stored = next((j for j, k in enumerate(keys) if k not in on_disk), len(keys))
            accepted = submit(core, f"again-{i}", prompt)[0]
            assert accepted.kind == "accepted"
            hits.append((accepted.num_hit_tokens, min(stored, (N - 1) // BS) * BS))
            core.cancel(f"again-{i}")
        assert [got for got, _ in hits] == [want for _, want in hits]
        assert hits[0][1] == 0 and hits[-1][1] == 5 * BS  # the first prompt's blocks went, the last one's stayed
