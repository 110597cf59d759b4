"""Reading a request of `gti serve`'s app: the JSON bodies, the query strings, their checks.

What it is for: `gti.serve.app`'s routes read every request through these, so each malformed
one gets a `RequestError` with a one-line message (never a traceback): `read_json` (the body:
413 / 415 / 400), `parse` (the body models `RecommendBody`, `BatchBody`, `ReloadBody`; 422
naming each wrong field), `read_query` and `int_param` (a GET route's query parameters: 400 /
422); `cut` / `short` cut a text or a value's repr for a one-line message.

What it does NOT know: the routes, the token, the loaded run (gti.serve.app, gti.serve.service).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from gti.serve.service import RequestError


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RecommendBody(_Body):
    history: list[str]
    k: StrictInt = 10
    exclude_history: StrictBool | None = None


class BatchBody(_Body):
    histories: list[list[str]]
    k: StrictInt = 10
    exclude_history: StrictBool | None = None


class ReloadBody(_Body):
    version: StrictInt | None = Field(None, ge=0)
    wait: StrictBool = False


def cut(text: str, n: int = 40) -> str:
    """`text` for a one-line message, cut to about `n` characters (a client may send a
    4,000-digit integer or a 60 kB key: the message names it, it does not repeat it)."""
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} characters)"


def short(value: Any, n: int = 40) -> str:
    return cut(repr(value), n)


def _check_content_type(value: str) -> None:
    """415 unless `value` is empty (taken as JSON: what a bare HTTP client sends) or a JSON media
    type (application/json, or application/<x>+json) with no charset or UTF-8's."""
    if not value.strip():
        return
    media, *params = [part.strip() for part in value.split(";")]
    media = media.lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise RequestError(415, f"Content-Type must be application/json, got {short(value)} "
                                "(curl: -H 'Content-Type: application/json')")
    for param in params:
        name, _, val = param.partition("=")
        if name.strip().lower() == "charset" and val.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise RequestError(415, f"the body must be UTF-8, Content-Type says charset={short(val.strip())}")


def _reject_constant(name: str) -> Any:
    # Python's json takes NaN and Infinity, which JSON does not have and no field takes.
    raise ValueError(f"{name} is not JSON")


def _no_surrogates(data: Any) -> None:
    """400 naming where a string (or key) holds an unpaired surrogate (a \\ud800 escape is valid
    JSON syntax but not Unicode text: it would fail later, when an answer echoing it is encoded)."""
    stack: list[tuple[str, Any]] = [("body", data)]
    while stack:  # iterative: the parser already accepted the nesting, a walk must not recurse
        where, value = stack.pop()
        texts: list[str] = []
        if isinstance(value, str):
            texts = [value]
        elif isinstance(value, dict):
            texts = list(value)
            stack += [(f"{where}.{cut(k, 20)}", v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise RequestError(400, f"{where}: a string holds an unpaired surrogate "
                                        f"({text[err.start]!a}), which is not Unicode text") from None


async def read_json(request: Request, limit: int, required: bool = True) -> dict[str, Any]:
    """The body as a JSON object: 413 over `limit` bytes (`serve.max_body_bytes`); 415 a
    Content-Type other than JSON in UTF-8 (none is taken as JSON); 400 not UTF-8, malformed JSON
    (NaN and Infinity included), JSON the parser cannot hold (an integer of more than 4,300
    digits, nesting deeper than the recursion limit), a string with an unpaired surrogate, or
    not an object (each one line)."""
    too_big = RequestError(413, f"request body over {limit} bytes (serve.max_body_bytes)")
    length = request.headers.get("content-length", "")
    # ASCII digits only ("²".isdigit() is True, int("²") raises), and no int() of 4,300 of them
    if length.isascii() and length.isdigit() and (len(length) > 18 or int(length) > limit):
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    if not body.strip():
        if required:
            raise RequestError(400, "empty body: send a JSON object")
        return {}
    _check_content_type(request.headers.get("content-type", ""))
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(400, f"the body is not UTF-8 (byte 0x{body[err.start]:02x} at offset {err.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise RequestError(400, f"malformed JSON: {err}") from None
    except RecursionError:
        raise RequestError(400, "malformed JSON: nested deeper than the parser allows") from None
    except ValueError as err:  # an integer of more than sys.get_int_max_str_digits() digits; NaN
        raise RequestError(400, f"malformed JSON: {str(err).split(';')[0]}") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(data).__name__}")
    _no_surrogates(data)
    return data


def read_query(request: Request, allowed: tuple[str, ...] = ()) -> dict[str, str]:
    """The query parameters of a GET route taking `allowed`: 400 a query string that is not
    UTF-8, 422 a parameter it does not take or one given twice."""
    route = f"{request.method} {request.url.path}"
    raw = request.scope.get("query_string", b"")
    try:
        # errors="strict": Starlette's own parse replaces bad bytes and would search for U+FFFD
        pairs = parse_qsl(raw.decode("utf-8"), keep_blank_values=True, errors="strict",
                          max_num_fields=max(8, 2 * len(allowed)))
    except UnicodeDecodeError:
        raise RequestError(400, f"{route}: the query string is not UTF-8 (percent-encode UTF-8 bytes)") from None
    except ValueError:  # more fields than max_num_fields
        raise RequestError(422, f"{route}: too many query parameters") from None
    takes = f"takes {' and '.join(allowed)}" if allowed else "takes no query parameters"
    unknown = sorted({name for name, _ in pairs} - set(allowed))
    if unknown:
        raise RequestError(422, f"unknown query parameter(s): {', '.join(cut(u, 30) for u in unknown[:5])} "
                                f"({route} {takes})")
    out: dict[str, str] = {}
    for name, value in pairs:
        if name in out:
            raise RequestError(422, f"query parameter {name} given more than once ({route})")
        out[name] = value
    return out


def int_param(query: dict[str, str], name: str, default: int, lo: int, hi: int, what: str = "") -> int:
    """Query parameter `name` as an integer in [lo, hi]; 422 naming it otherwise. Only ASCII
    digits count: "²".isdigit() is True and int("²") raises."""
    raw = query.get(name, str(default))
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9 and lo <= int(raw) <= hi):
        raise RequestError(422, f"{name} must be an integer from {lo} to {hi}{what}, got {short(raw)}")
    return int(raw)


def parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """`data` as `model`; 422 naming each wrong field."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        parts = [f"{'.'.join(cut(str(x), 30) for x in e['loc']) or 'body'}: {e['msg']}" for e in err.errors()[:5]]
        raise RequestError(422, "; ".join(parts)) from None
