"""Expert-parallel dispatch + combine implementations."""
