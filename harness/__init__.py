"""ep-harness: correctness and determinism checks for MoE expert-parallel inference stacks."""

__version__ = "0.1.0"
