"""The scheduler: policy as pure code (``policy``), and the gRPC service around it (``service``)."""
