"""The one error type for checkpoints that cannot be loaded."""


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt or of an unsupported kind; the message names it."""
