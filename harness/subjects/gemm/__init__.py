"""Grouped and dense GEMM implementations, one file per library."""
