"""Errors that cross module boundaries (engine -> server), so each layer can map them."""


class QueueFullError(RuntimeError):
    """The engine cannot take the request now: retry later (the server answers 503 +
    Retry-After). ``reason``: "queue_full" (the waiting queue holds ``max_waiting``
    sequences) or "queue_delay" (its predicted wait exceeds ``max_queue_delay_ms``,
    engine/admission.py); ``retry_after_s``: when a retry may succeed, if known."""

    def __init__(self, message: str = "", reason: str = "queue_full", retry_after_s: int | None = None):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine loop has died; no request can be served (the server's /health answers 503)."""


class StepFailedError(RuntimeError):
    """A step raised on the host or the device; the requests it held were aborted (pages
    back) and the engine goes on. ``request_ids``: those requests (the server answers each
    with a 500 in the API's error shape)."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"a step failed ({type(cause).__name__}); {len(request_ids)} request(s) aborted")
        self.request_ids = request_ids
        self.cause = cause


class RequestFailedError(RuntimeError):
    """This request was in a step that failed (StepFailedError); other requests go on."""
