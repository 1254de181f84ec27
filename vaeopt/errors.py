"""User-facing errors: the CLI prints these as one clear line and exits non-zero (no traceback)."""


class VaeoptError(Exception):
    """An error caused by the user's input or environment, with a message meant to be read."""

    exit_code = 2


class CheckpointError(VaeoptError):
    """The checkpoint is missing, unreadable, unsafe, or of a family we do not know."""


class LatentError(VaeoptError):
    """The latents are missing, unreadable, or do not fit the model."""


class OutputError(VaeoptError):
    """The output cannot be written."""


class DecodeError(VaeoptError):
    """The decode ran but its result is unusable (NaN/Inf output): nothing is written."""


class DistributedError(VaeoptError):
    """A rank failed, timed out, or the ranks disagree (different latents, unsupported model)."""
