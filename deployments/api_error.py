"""The error a client caused (or an overload it should retry), as an OpenAI error body with its HTTP status;
``openai_protocol`` re-exports it for the routes."""

from __future__ import annotations


class APIError(ValueError):
    """An error the client caused (or an overload it should retry), with its HTTP status."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(max(1, round(self.retry_after_s)))}


def from_value_error(exc: ValueError) -> APIError:
    """Our library raises ``ValueError("field: what is wrong")``; keep the field as ``param``."""
    if isinstance(exc, APIError):
        return exc
    message = str(exc)
    field, sep, _ = message.partition(":")
    param = field.strip() if sep and field and " " not in field.strip() else None
    return APIError(message, param=param)
