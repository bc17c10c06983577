"""draftsmith: train speculative-decoding drafters and measure how fast they make the target."""

__version__ = "0.1.0"


class DraftsmithError(Exception):
    """A user-facing error: the CLI prints it as one line and exits non-zero."""
