"""MoE layers composed from stage subjects."""
