"""Per-token-group FP8 quantization implementations."""
