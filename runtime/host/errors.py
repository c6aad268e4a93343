"""The errors a request can meet, by type: every front end catches these by class, never by text.

  RequestError  the request itself is wrong (a field out of range, a prompt too long, an unknown
                adapter): HTTP 400, gRPC INVALID_ARGUMENT, a JSONL error record. `field` names
                the input field at fault, `reason` says why; the message is built from the two.
  QueueFull     the engine cannot take it now (back-pressure): retry later. HTTP 429, gRPC
                RESOURCE_EXHAUSTED; JSONL batch holds the line and retries after a step.
  Overloaded    a QueueFull: with latency targets and refuse_late, the queue ahead would make it
                miss its TTFT target; `retry_after_s` says when to try again.
  EngineAsleep  a QueueFull: the engine gave its device memory back (sleep): HTTP 503, retry
                after it wakes.
  UnknownAdapter / AdapterInUse   unloading a LoRA adapter that is not loaded (HTTP 404) or that
                an unfinished request still uses (HTTP 409).
"""


class RequestError(ValueError):
    """A request the engine cannot serve. `field` names the input field at fault ("top_k",
    "prompt", "messages[0].content", ...) or is None for the request as a whole."""

    def __init__(self, field: str | None, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message


class QueueFull(Exception):
    """The waiting queue is full; the caller should retry later (back-pressure)."""


class Overloaded(QueueFull):
    """The queue ahead would make this request miss its TTFT target (refuse_late);
    `retry_after_s`: when the queue is predicted to have room."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineAsleep(QueueFull):
    """The engine is asleep (Engine.sleep): no request runs until wake_up."""


class UnknownAdapter(ValueError):
    """No LoRA adapter of that name is loaded."""


class AdapterInUse(ValueError):
    """The LoRA adapter serves an unfinished request: it cannot be unloaded now."""
