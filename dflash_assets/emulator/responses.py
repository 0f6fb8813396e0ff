"""Response bodies as 0.5.23 shapes them, by route and by where the error was raised:

- `/generate` contract gate:         400 {"error": "<serde text>"}
- `/generate` ValueError:            400 {"error": {"message": ...}}
- OpenAI routes (serving_base):      {"object": "error", "message", "type", "param": null, "code"}, type
  "BadRequestError" (generate-time), "BadRequest" (conversion), "503" (HTTPException, e.g. a full queue)
- FastAPI request validation:        400 {"object": "error", ..., "type": "Bad Request"}
- inside a stream:                   data: {"error": {...}} then data: [DONE]
"""

from __future__ import annotations

import json

from aiohttp import web

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def dumps(obj) -> str:
    return _dumps(obj)


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(obj).encode(), status=status, content_type="application/json")


def raw_json_response(text: str, status: int = 200) -> web.Response:
    return web.Response(body=text.encode(), status=status, content_type="application/json")


def contract_error(message: str) -> web.Response:
    return json_response({"error": message}, 400)


def generate_error(message: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": message}}, status)


def openai_error_body(message: str, err_type: str, status: int) -> dict:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}


def openai_error(message: str, err_type: str = "BadRequestError", status: int = 400) -> web.Response:
    return json_response(openai_error_body(message, err_type, status), status)


def http_exception(message: str, status: int) -> web.Response:
    """FastAPI's HTTPException handler (http_server.py): type is the status as a string."""
    return openai_error(message, str(status), status)


def validation_error(errors: list[dict]) -> web.Response:
    """RequestValidationError, a 400 by SGLang's handler, with pydantic's error list (its wording approximated)."""
    return openai_error(str(errors), "Bad Request", 400)


def field_error(kind: str, loc: tuple, msg: str, value, **extra) -> dict:
    """One pydantic error of a RequestValidationError's list, its keys in pydantic's order."""
    return {"type": kind, "loc": loc, "msg": msg, "input": value, **extra}


def sse(obj) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
HTTP_STATUS_NAMES = {400: "BAD_REQUEST", 503: "SERVICE_UNAVAILABLE", 500: "INTERNAL_SERVER_ERROR"}


async def read_json(request: web.Request, *, require_json_content_type: bool):
    """The parsed body, or an error Response as FastAPI would answer."""
    if require_json_content_type:  # validate_json_request on the OpenAI routes
        media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            return validation_error(
                [
                    {
                        "loc": ["header", "content-type"],
                        "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                        "type": "value_error",
                    }
                ]
            )
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError as e:
        return validation_error(
            [field_error("json_invalid", ("body", 0), "JSON decode error", {}, ctx={"error": str(e)})]
        )
