"""Pure-torch references: float64 (or exact) results and accumulation-order models.

Nothing here imports the harness: a reference must be checkable on its own.
"""
