"""User-facing errors: one line that names the problem and the fix."""


class HarnessError(Exception):
    """Bad input or an unusable environment; printed as one line, exit code 2."""
