"""Two traffic managers (a prefill side and a decode side) moving real KV bytes through both read paths."""

import torch

from dualpath.core.config import StorageConfig, TransportConfig
from dualpath.core.geometry import FullBlockSlots, KVGeometry, LayerMajorBlocks
from dualpath.kernels.kv_move import layer_tokens_from_full
from dualpath.traffic.buffer import BufferPool
from dualpath.traffic.manager import LayerPipeline, PeerRegion, TrafficManager
from dualpath.traffic.storage import make_storage
from dualpath.traffic.transport import Op, make_transport
from dualpath.traffic.transport.local import LocalHub

GEOM = KVGeometry(num_layers=4, block_size=8, kv_elems_per_token=6, dtype="float32")
FP = b"m" * 16


def manager(name, hub, root, slots=16):
    t = make_transport(TransportConfig(name="local"), name, hub=hub)
    mem = t.allocate(slots * GEOM.full_block_bytes)
    region = t.register(mem).region_id
    storage = make_storage(StorageConfig(root=str(root)), GEOM, FP)
    return TrafficManager(GEOM, storage, BufferPool(GEOM, slots, mem), t, region)


def test_pe_path_and_de_path_move_exact_bytes(tmp_path):
    hub = LocalHub()
    pe, de = manager("pe", hub, tmp_path), manager("de", hub, tmp_path)
    # the PE's device workspace: two layer slots (layer l uses slot l % 2) of up to 4 blocks each
    work = torch.zeros(2 * 4 * GEOM.layer_block_bytes, dtype=torch.uint8)
    work_region = pe.transport.register(work).region_id
    work_layout = LayerMajorBlocks(GEOM, 4, num_layers=2)
    for a, b in ((pe, de), (de, pe)):
        a.transport.add_peer(b.transport.endpoint, b.transport.address(), b.transport.regions())
    keys = [bytes([i]) * 16 for i in range(3)]
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randint(0, 256, (GEOM.full_block_bytes,), dtype=torch.uint8, generator=g) for _ in keys]
    assert pe.store(keys, blocks).result() == [None] * 3

    # PE path: storage -> PE buffer; per layer the PE writes the layer to the DE buffer.
    pe_slots, de_slots = pe.buffer.allocate(3, "r1"), de.buffer.allocate(3, "r1")
    assert pe.load(keys, pe_slots).result() == [None] * 3
    de_buf = PeerRegion("de", de.buffer_region, de.buffer.layout)
    pipe = LayerPipeline(
        GEOM.num_layers,
        lambda layer: None,
        lambda layer: pe.move_layers(Op.WRITE, pe.buffer_region, pe.buffer.layout, pe_slots, de_buf, de_slots, [layer]),
    )
    pipe.begin()
    for layer in range(GEOM.num_layers):
        pipe.wait_layer(layer)
        pipe.layer_done(layer)
    pipe.finish()
    for s, b in zip(de_slots, blocks):
        assert torch.equal(de.buffer.slot_bytes(s), b)

    # DE path: storage -> DE buffer; per layer the PE reads that layer into its workspace.
    de_slots2 = de.buffer.allocate(3, "r2")
    assert de.load(keys, de_slots2).result() == [None] * 3
    seen = []
    pipe = LayerPipeline(
        GEOM.num_layers,
        lambda layer: pe.move_layers(Op.READ, work_region, work_layout, [0, 1, 2], de_buf, de_slots2, [layer]),
        lambda layer: None,
    )
    pipe.begin()
    for layer in range(GEOM.num_layers):
        pipe.wait_layer(layer)
        slot = (layer % 2) * 4 * GEOM.layer_block_bytes
        seen.append(work[slot : slot + 3 * GEOM.layer_block_bytes].clone())
        pipe.layer_done(layer)
    pipe.finish()
    lb = GEOM.layer_block_bytes
    for layer, got in enumerate(seen):
        want = torch.cat([b[layer * lb : (layer + 1) * lb] for b in blocks])
        assert torch.equal(got, want)

    # Miss tokens only: tokens [5, 20) of layer 2 written back beside what is there.
    before = [de.buffer.slot_bytes(s).clone() for s in de_slots2]
    work.random_(0, 256, generator=g)
    pe.move_layers(Op.WRITE, work_region, work_layout, [0, 1, 2], de_buf, de_slots2, [2], tokens=(5, 20)).wait(5)
    tb = GEOM.token_bytes
    for j, s in enumerate(de_slots2):
        after = de.buffer.slot_bytes(s)
        for t in range(8):
            tok = j * 8 + t
            off = FullBlockSlots(GEOM, 16).offset(0, 2) + t * tb
            expect = work[(j * 8 + t) * tb : (j * 8 + t + 1) * tb] if 5 <= tok < 20 else before[j][off : off + tb]
            assert torch.equal(after[off : off + tb], expect)

    counts = pe.snapshot()
    assert counts["storage_read:kv"] == 3 * GEOM.full_block_bytes
    assert counts["peer_write:kv"] == 3 * GEOM.full_block_bytes + 15 * tb
    assert counts["peer_read:kv"] == 3 * GEOM.full_block_bytes
    for m in (pe, de):
        m.buffer.free_owner("r1")
        m.buffer.free_owner("r2")
        assert m.buffer.leaks() == {}


def test_layer_to_device_gathers_one_layer_of_the_slots(tmp_path):
    m = manager("x", LocalHub(), tmp_path, slots=4)
    m.buffer.memory.tensor.copy_(torch.randint(0, 256, (m.buffer.memory.nbytes,), dtype=torch.uint8))
    out = torch.empty(2 * GEOM.block_size, GEOM.kv_elems_per_token)
    m.layer_to_device([3, 1], 2, out)
    want = layer_tokens_from_full(m.buffer.full_blocks([3, 1]), 2, GEOM)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))  # bytes: random bits hold NaNs
