"""Per-family executors: how a property's runs are built, executed and compared.

Each executor maps (check, subject, rank context) to the measured part of a record.
"""
from __future__ import annotations

from harness.families import collective

EXECUTORS = {
    "collective": collective.execute,
}

PROPERTIES = {
    "collective": collective.PROPERTIES,
}
