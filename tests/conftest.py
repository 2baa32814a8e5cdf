import os
import sys
from pathlib import Path

import pytest

# Tests mirror the package tree (tests/engines/, tests/serving/, ...); what they share lives in tests/support/.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
# The repository's kernels/, engines/, traffic/, scheduler/ are dualpath's subpackages (pyproject's package-dir), and
# the installed dualpath is what runs. Seen from the repository root as top-level names they would shadow other
# distributions' (Hugging Face's `kernels`, which transformers imports): the root leaves sys.path (`python -m pytest`
# puts it there), and subprocesses get PYTHONSAFEPATH (Python 3.11+), so their `python -m` and `-c` do not add it.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
os.environ.setdefault("PYTHONSAFEPATH", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in its interpreter (numpy) on CPU tensors; it must be chosen before any
# kernel is defined, so here, before test modules import them.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from archs import ARCHS  # noqa: E402 - (tests/support is on sys.path from here on)


@pytest.fixture(autouse=True, scope="session")
def small_cpu_caches():
    """In-process engines on CPU get 256 MiB KV caches, not the product's 1 GiB: the tests' prompts need a few
    MiB, and each 1 GiB cache is zeroed page by page (0.3 s) and held until the collector frees it."""
    import dualpath.engines.memory

    patch = pytest.MonkeyPatch()
    patch.setattr(dualpath.engines.memory, "CPU_CACHE_BYTES", 256 << 20)
    yield
    patch.undo()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints of every supported architecture, built once per test session."""
    from dualpath.checkpoints.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {a: build_tiny_checkpoint(root / a, a, seed=1) for a in ARCHS}


@pytest.fixture(scope="session")
def tiny_adapters(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    """Two random LoRA adapters (PEFT's files) of the tiny Llama: "sql" trains every projection, "poet" only q and v
    (rsLoRA's scale)."""
    from dualpath.checkpoints.tiny import build_tiny_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": build_tiny_adapter(root / "sql", tiny_dirs["llama"], seed=3),
        "poet": build_tiny_adapter(
            root / "poet", tiny_dirs["llama"], seed=4, rank=8, targets=("q_proj", "v_proj"), rslora=True, std=0.3
        ),
    }


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model, converted once into the user cache directory (as ``dualpath serve`` does)."""
    from dualpath.checkpoints.smollm2 import default_model_dir

    return default_model_dir(progress=False)


def pytest_sessionfinish(session, exitstatus):
    session.config._dualpath_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import sys

    if any(name.startswith("nixl") for name in sys.modules):
        # NIXL's bundled libraries crash in their exit-time destructors (libnl's rtnl_tc_unregister), so a
        # process that loaded NIXL leaves without running them, keeping pytest's exit status.
        from dualpath.traffic.memory import remove_segments

        remove_segments(os.getpid())  # what this process shared: no finalizer runs after os._exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(getattr(config, "_dualpath_exitstatus", 0))
