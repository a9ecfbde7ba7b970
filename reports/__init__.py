"""Renderings of a run's records: terminal table, assertion text, one self-contained HTML page.

Reads `results.jsonl` and `environment.json` only, and imports no torch, so any run can
be re-rendered anywhere.
"""
