"""The cost wing: benchmarks and GPU cost tables (timed interleaved, medians), never verdicts."""
