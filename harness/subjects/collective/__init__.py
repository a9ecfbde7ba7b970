"""Tensor-parallel reduce-scatter implementations, one file each."""
