"""The data plane: KV storage, DRAM buffers, transports with priority classes, and the traffic manager."""
