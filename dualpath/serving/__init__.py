"""Serving: the OpenAI-compatible HTTP frontend and ``dualpath serve``."""
