"""The run wing: a run's steps, from a suite to records: planning the checks, compiling their
kernels first, the ranks' worker loop, relaunches in fresh processes, and explore's search."""
