"""The one exception type mlxmoe raises for bad input; the CLI prints it without a traceback."""


class MlxmoeError(Exception):
    """A problem with the user's input (files, sizes, options) that names what is wrong."""
