"""Errors that are the user's to fix: printed as one paragraph, never as a bare traceback."""


class UserError(Exception):
    """Bad config, a missing file or column, an input the run cannot use. The message names the
    problem and the fix; the entry point prints it and exits with status 2."""
