"""The NCCL wing: what NCCL logged (log.py), what a launch pins it to and whether the pins
held (pins.py), which accumulation-order model predicts a logged call (models.py: a table
(function, algorithm) -> model over the pure orders in reference/), and the run's statement
of what its TP reductions went through (statement.py)."""
