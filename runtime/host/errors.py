"""The request door's one error type (runtime/host/requests.py; runtime/host/structured.py raises it too)."""


class RequestError(ValueError):
    """A request the engine cannot serve. `field` names the input field at fault ("top_k",
    "prompt", "messages[0].content", ...) or is None for the request as a whole."""

    def __init__(self, field: str | None, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message
