"""A prefill engine prepares each assignment on a thread of its own, and the first assignments naming a decode
engine it has not met yet may run at once: each must get that engine's client. Found by
tests/scheduler/test_read_balance.py, where one in a few runs retried a request after "preparing failed: 'd0'":
one thread had recorded the peer and not yet its client when the other looked the client up."""

import threading
import time

from dualpath.core.messages import Assignment, ReadPath
from dualpath.core.sampling_params import SamplingParams
from dualpath.engines import prefill
from engine_doubles import prefill_with_decode_peer

BS = 16


def test_concurrent_first_assignments_to_a_decode_engine_each_get_its_client(tiny_dirs, tmp_path, monkeypatch):
    with prefill_with_decode_peer(tiny_dirs["llama"], tmp_path, BS) as (pe, peer):
        made = []

        def slow_client(*args):  # opening a channel takes a while: the window the other thread falls in
            time.sleep(0.2)
            made.append(args)
            return object()

        monkeypatch.setattr(prefill, "Client", slow_client)
        params = SamplingParams(temperature=0, max_tokens=1)
        got, errors = [], []

        def prepare(w: str) -> None:
            try:
                got.append(pe._de(Assignment(w, [3] * BS, params.to_dict(), [], ReadPath.PE, True, peer.info)))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        first = threading.Thread(target=prepare, args=("a",))
        first.start()
        time.sleep(0.05)  # "a" is opening the client
        prepare("b")
        first.join(10)
        assert not errors, errors
        assert len(got) == 2 and got[0] is got[1] and len(made) == 1  # one client, shared
