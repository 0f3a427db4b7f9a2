"""The one error class of the data pipeline."""

from megatron_branchnorm.errors import UserError


class DataError(UserError, ValueError):
    """Bad data input or a damaged output file; the one-line message names the file (and line)."""
