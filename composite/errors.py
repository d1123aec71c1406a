"""User-facing errors: one line, no traceback; exit code 2 for bad input, 1 for a run that failed."""

from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """A problem with what the user gave us (flags, files, config). The message is the whole story."""


class Failure(Exception):
    """A run that could not finish for a reason outside the user's input (a worker process killed,
    a cluster lost): one line that says what and why, exit code 1."""


def exits_cleanly(main):
    """Wrap a CLI entry point: a UserError becomes one line on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        except Failure as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper
