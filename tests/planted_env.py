"""A plugin that, imported by rank 1 of a launch, drops a variable the launcher pinned: that
rank would measure under other conditions than the others (tests/test_proof_of_path.py)."""
import os

if os.environ.get("RANK") == "1":
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
