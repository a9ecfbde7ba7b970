"""The regression wing: baselines, the gate that compares a run with them, and the nightly job."""
