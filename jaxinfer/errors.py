"""Errors that cross module boundaries (engine -> server), so each layer can map them."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full: retry later (the server answers 503 + Retry-After)."""


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
