"""What every script of this repo does the same way at its edges.

    UserError, exit_on_user_error   bad input: one line on stderr, "error: <what to do>", exit code 2

A script raises UserError wherever it finds input the user must fix (a missing checkpoint, an unknown
dataset, a bad setting) and decorates its main() with exit_on_user_error. Anything else is a bug and
keeps its traceback.
"""

import functools
import sys


class UserError(Exception):
    """Input the user must fix. str(e) is one line that says what to do; `details` (optional) are
    further lines printed after it, e.g. the valid keys of a config."""

    def __init__(self, message, details=""):
        super().__init__(message)
        self.details = details


def exit_on_user_error(main):
    """Decorator for a script's main(): a UserError prints 'error: <message>' (then its details) on
    stderr and exits with code 2; other exceptions propagate unchanged."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}" + (f"\n{e.details}" if e.details else ""), file=sys.stderr)
            sys.exit(2)
    return wrapper
