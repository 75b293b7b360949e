"""The API's error answers: OpenAI's envelope `{"error": {"message", "type", "param", "code"}}`, and what a
request body's validation errors (pydantic's) become in it.

Every part of the server answers with `error_response`: the app's handlers, the `Guard` middleware, Ray
Serve's proxy middleware; the batch job words its invalid records with `describe_invalid`.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from verispec.serving.http.schemas import UNSUPPORTED

__all__ = ["ERROR_TYPES", "describe_invalid", "error_response"]

ERROR_TYPES = {401: "authentication_error", 408: "timeout_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
               504: "timeout_error"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status,
                        headers=headers)


def _field_path(loc: tuple) -> list[str]:
    """A pydantic error location as field names: without "body" and without union branch tags
    (`str`, `list[int]`, `function-after[…]`), which say which alternative failed, not where."""
    return [str(part) for part in loc if part not in ("body", "str", "int") and not (isinstance(part, str) and "[" in part)]


def describe_invalid(errors: list[dict]) -> tuple[int, str, str | None]:
    """(status, message, param) for pydantic validation errors of a request body: the first problem, named.
    A value an unimplemented OpenAI field cannot take, an unknown field and text that is not valid
    Unicode are 400s; a value out of range is a 422."""
    unicode = [error for error in errors if error["type"] == "unicode_invalid"]  # whichever union branch
    first = (unicode or errors or [{"type": "", "loc": (), "msg": "invalid request"}])[0]
    if first["type"] == "json_invalid":
        return 400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    path = _field_path(first["loc"])
    if not path:
        return 422, f"the request body is invalid ({first['msg']}): send a JSON object", None
    field = ".".join(path)
    if path[0] in UNSUPPORTED and len(path) <= 2:
        return 400, f"{path[0]}: {UNSUPPORTED[path[0]].format(input=first.get('input'))}", path[0]
    if first["type"] == "extra_forbidden":
        return 400, f"unknown field '{field}': this server does not implement it (see /openapi.json for every field)", path[0]
    if first["type"] == "unicode_invalid":
        return 400, f"invalid '{field}': {first['msg']}", path[0]
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return 422, f"invalid '{field}': {first['msg']}{more}", path[0]
