"""What the documentation tests share: the ``dualpath serve`` processes the README's and the docs' examples talk
to (``doc_blocks.DocServers``: one per set of arguments, started when a block first needs it, stopped at the end
of the session)."""

import pytest

from doc_blocks import DocServers


@pytest.fixture(scope="session")
def doc_servers(smollm2_dir, tmp_path_factory):
    servers = DocServers(tmp_path_factory.mktemp("doc-cache"), smollm2_dir.parent)
    yield servers
    failed = servers.stop()
    assert not failed, "\n".join(failed)
