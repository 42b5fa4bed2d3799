"""Errors shared by every tier. Plain and picklable; the transport layers map them to status codes."""


class DsparkError(Exception):
    """Base of every error this project raises on purpose."""


class ModelLoadError(DsparkError):
    """A model directory, config or tensor is missing, malformed or unsupported."""


class InvalidRequestError(DsparkError):
    """The request itself is wrong (bad sampling parameters, prompt too long, a token id outside the vocabulary,
    a malformed tensor or draft block). An unknown request id is a StaleCycleError."""


class CapacityError(DsparkError):
    """The request is valid but does not fit now (no KV slot, queue full); the client may retry."""


class StaleCycleError(DsparkError):
    """A session message for an unknown request, or whose cycle is not the one the tier expects."""


class TierUnavailableError(DsparkError):
    """A drafter or verifier could not be reached or went away mid-call; the router recovers."""
