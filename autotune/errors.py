"""The one error type a user sees.

Bad input (a field out of range, a layout that does not divide, a file that is not
YAML) is the user's to fix, so it is reported as one line that names the field and
the rule, and the command exits with code 2. Everything else is a bug and keeps its
traceback.
"""


class UsageError(Exception):
    """Bad input: printed as one line by the CLI, which then exits with code 2."""
