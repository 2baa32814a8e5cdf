"""Engines that span devices: tensor-parallel ranks (``comm``), the steps they run together (``steps``) and the
processes that run them (``ranks``)."""
