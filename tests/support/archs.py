"""The architectures the tiny random checkpoints cover (``tests/conftest.py`` builds one of each)."""

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32")
