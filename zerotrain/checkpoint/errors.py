"""CheckpointError: a checkpoint that cannot be written or read, with the file to blame."""


class CheckpointError(RuntimeError):
    """Raised for a missing, truncated, foreign or inconsistent checkpoint; the message names the file."""
