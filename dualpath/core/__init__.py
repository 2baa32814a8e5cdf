"""The ground every layer stands on: configs, the KV block geometry, errors, the wire messages and their RPC, sampling
parameters, structured-output constraints, the tokenizer, paths, metrics helpers and fault points.

Modules here import nothing of dualpath above them (the import contract in ``pyproject.toml``, checked by
``tests/test_layers.py``): engines, traffic, kernels and the scheduler build on the core, the product (CLI, HTTP
frontend, ``LLM``, rollouts, the simulator) on all of them.
"""
