"""gti/serve/requests.py on its own (no app, no run): the body reader, the body models, the query
string reader and `int_param`, each on a hand-built Starlette request. What the routes make of
them (the same messages through HTTP) is tests/serve/test_bad_requests.py."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from gti.serve.requests import (BatchBody, RecommendBody, ReloadBody, cut, int_param, parse, read_json, read_query,
                                short)
from gti.serve.service import RequestError


def _request(body: bytes = b"", headers: dict[str, str] | None = None, query: bytes = b"",
             method: str = "POST", path: str = "/recommend") -> Request:
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "query_string": query, "root_path": "",
             "scheme": "http", "server": ("127.0.0.1", 80),
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    return Request(scope, receive)


def _read(body: bytes, limit: int = 1000, required: bool = True, **headers: str):
    return asyncio.run(read_json(_request(body, {k.replace("_", "-"): v for k, v in headers.items()}), limit, required))


def _raises(status: int, message: str, fn, *args, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn(*args, **kwargs)
    assert info.value.status == status and message in info.value.message, (info.value.status, info.value.message)
    return info.value


def test_read_json_takes_an_object():
    assert _read(b'{"history": ["a"], "k": 2}') == {"history": ["a"], "k": 2}
    assert _read(b'{"a": 1}', content_type="application/vnd.x+json; charset=utf-8") == {"a": 1}
    assert _read(b"  ", required=False) == {}


@pytest.mark.parametrize("body, headers, status, message", [
    (b"", {}, 400, "empty body: send a JSON object"),
    (b"[1]", {}, 400, "the body must be a JSON object, got list"),
    (b"{", {}, 400, "malformed JSON"),
    (b'{"k": NaN}', {}, 400, "NaN is not JSON"),
    (b'{"k": ' + b"9" * 5000 + b"}", {"limit": 10000}, 400, "4300 digits"),
    (b'{"h": ["\\ud800"]}', {}, 400, "body.h[0]: a string holds an unpaired surrogate"),
    (b'{"h": "\xff"}', {}, 400, "the body is not UTF-8 (byte 0xff at offset 7)"),
    (b"{}", {"content_type": "text/plain"}, 415, "Content-Type must be application/json"),
    (b"{}", {"content_type": "application/json; charset=latin-1"}, 415, "charset='latin-1'"),
    (b"{" + b" " * 2000 + b"}", {}, 413, "request body over 1000 bytes (serve.max_body_bytes)"),
    (b"{}", {"content_length": "5000"}, 413, "over 1000 bytes"),
])
def test_read_json_refuses_with_one_line(body, headers, status, message):
    headers = dict(headers)
    limit = headers.pop("limit", 1000)
    err = _raises(status, message, _read, body, limit, **headers)
    assert "\n" not in err.message and len(err.message) < 300


def test_read_json_does_not_trust_a_content_length_that_is_not_ascii_digits():
    assert _read(b"{}", content_length="²") == {}


def test_parse_names_each_wrong_field():
    body = parse(RecommendBody, {"history": ["a"]})
    assert (body.history, body.k, body.exclude_history) == (["a"], 10, None)
    assert parse(BatchBody, {"histories": [["a"]], "exclude_history": False}).exclude_history is False
    assert parse(ReloadBody, {}).version is None
    _raises(422, "k: Input should be a valid integer", parse, RecommendBody, {"history": ["a"], "k": "3"})
    _raises(422, "x: Extra inputs are not permitted", parse, RecommendBody, {"history": ["a"], "x": 1})
    _raises(422, "version: Input should be greater than or equal to 0", parse, ReloadBody, {"version": -1})
    _raises(422, "exclude_history: Input should be a valid boolean", parse, BatchBody,
            {"histories": [], "exclude_history": 1})


def test_read_query_and_int_param():
    get = lambda q: _request(method="GET", path="/items", query=q)  # noqa: E731
    assert read_query(get(b"q=abc&limit=3"), ("q", "limit")) == {"q": "abc", "limit": "3"}
    _raises(422, "unknown query parameter(s): x (GET /items takes q)", read_query, get(b"x=1"), ("q",))
    _raises(422, "(GET /items takes no query parameters)", read_query, get(b"x=1"))
    _raises(422, "query parameter q given more than once (GET /items)", read_query, get(b"q=1&q=2"), ("q",))
    _raises(400, "GET /items: the query string is not UTF-8", read_query, get(b"q=%FF"), ("q",))
    _raises(422, "too many query parameters", read_query, get(b"&".join(b"a%d=1" % i for i in range(20))), ("q",))
    assert int_param({}, "limit", 20, 1, 50) == 20
    assert int_param({"limit": "50"}, "limit", 20, 1, 50) == 50
    for raw in ("0", "51", "²", "-1", "1.5", "", "9" * 20):
        _raises(422, "limit must be an integer from 1 to 50 (x)", int_param, {"limit": raw}, "limit", 20, 1, 50, " (x)")


def test_cut_and_short_keep_a_message_to_one_short_line():
    assert cut("abc") == "abc"
    assert cut("x" * 100, 10) == "xxxxxxxxxx... (100 characters)"
    assert short("a") == "'a'" and short(9 ** 100).endswith("(96 characters)")
