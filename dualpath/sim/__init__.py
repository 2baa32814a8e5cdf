"""Cluster modelling: the hardware, the links every KV transfer crosses, and the P/D planner built on them."""
