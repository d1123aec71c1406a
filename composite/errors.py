"""User-facing errors: one line, exit code 2, no traceback."""

from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """A problem with what the user gave us (flags, files, config). The message is the whole story."""


def exits_cleanly(main):
    """Wrap a CLI entry point: a UserError becomes one line on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper
