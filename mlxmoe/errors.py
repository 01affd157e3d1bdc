"""The one exception type mlxmoe raises for bad input; the CLI prints it without a traceback."""

import os


class MlxmoeError(Exception):
    """A problem with the user's input (files, sizes, options) that names what is wrong."""


def read_lines(path, what):
    """The lines of a user's text file, or an MlxmoeError that names it."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        raise MlxmoeError(f"{what} not found: {path}") from None
    except UnicodeDecodeError:
        raise MlxmoeError(f"{path}: not a UTF-8 text file") from None
    except OSError as e:
        raise MlxmoeError(f"cannot read {what} {path}: {e.strerror}") from None
