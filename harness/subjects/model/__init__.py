"""The probe model composed from stage subjects (composed.py) and its definition (common.py)."""
