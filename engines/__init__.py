"""Engines: models with a layerwise forward, the paged KV cache, sampling and the engine processes."""
