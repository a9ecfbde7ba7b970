"""Device kernels the harness itself runs (not subjects)."""
