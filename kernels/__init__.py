"""Model math as small functions: torch references for every kernel, GPU kernels beside them where they pay."""
