"""The one error class of the data pipeline."""


class DataError(ValueError):
    """Bad data input or a damaged output file; the one-line message names the file (and line)."""
