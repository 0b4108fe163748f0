"""Errors that cross module boundaries (engine -> server), so each layer can map them."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full: retry later (the server answers 503 + Retry-After)."""


class EngineDeadError(RuntimeError):
    """The engine loop has died; no request can be served (the server's /health answers 503)."""
