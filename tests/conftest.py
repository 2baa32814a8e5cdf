import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ARCHS = ("llama", "qwen2", "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints of every supported architecture, built once per test session."""
    from dualpath.checkpoints.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {a: build_tiny_checkpoint(root / a, a, seed=1) for a in ARCHS}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model, converted once into the user cache directory (as ``dualpath serve`` does)."""
    from dualpath.checkpoints.smollm2 import default_model_dir

    return default_model_dir(progress=False)
