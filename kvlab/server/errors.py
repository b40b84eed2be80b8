"""APIError: any problem with a request, as OpenAI's API shapes it: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- each API's own error shape (Ollama's /api/*, Anthropic's /v1/messages; OpenAI's everywhere else) ----

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def api_of(path: str) -> str:
    """"ollama", "anthropic" or "openai": whose error shape a request to `path` gets."""
    if path.startswith("/api/") and not path.startswith("/api/web/"):
        return "ollama"
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return "openai"


def error_body(path: str, e: APIError) -> dict:
    """The error as the API the path belongs to writes it: Ollama's {"error": message}, Anthropic's
    {"type": "error", "error": {"type", "message"}}, else OpenAI's."""
    api = api_of(path)
    if api == "ollama":
        return {"error": e.message}
    if api == "anthropic":
        kind = _ANTHROPIC_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": e.message}}
    return e.body()
