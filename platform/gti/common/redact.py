"""What counts as a secret, and how it is kept out of manifests, logs and quarantine files.

What it is for: `is_secret_key(name)` (a config key or URI query parameter that names a secret,
in any spelling: `api_key`, `apiKey`, `api-key`, `auth`, `passphrase`, `connection_string`,
`X-Amz-Signature`, `AWSAccessKeyId`), `redact_text(text)` (the credentials inside every URI in a
text: `https://user:pass@host/x` -> `https://***@host/x`, presigned query values such as
`X-Amz-Signature`, `X-Amz-Credential`, `sig`, `token` -> `***`) and `redact_strings(obj)` (that, on
every string of a nested structure). `gti.config.io.redact` masks whole config values with them.
Used where a value leaves the process: manifests (`Manifest.write`), stage and refresh logs,
the CLI's error line, the ingest quarantine's `source_file` and skipped-file facts.

What it does not know: configs, files or Ray (a pure module: the data readers import it).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

REDACTED = "***redacted***"
URI_SECRET = "***"  # what stands for a URI's user:password or a presigned query value

# A key is secret when its last word is one of these (words split on _ - . space and camelCase:
# `api_key`, `apiKey`, `api-key`, `X-Amz-Signature`, `basic_auth`, `db.passphrase`) ...
_SECRET_WORDS = frozenset({
    "key", "token", "secret", "password", "passwd", "pwd", "credential", "credentials", "auth",
    "authorization", "passphrase", "signature", "sig", "cookie", "apikey", "sas",
})
# ... or its last two words are one of these (`connection_string`, `AWSAccessKeyId`) ...
_SECRET_PAIRS = frozenset({("connection", "string"), ("key", "id"), ("private", "key")})
# ... or the key with its separators removed ends with one of these (`apikey`, `connectionstring`).
_SECRET_TAILS = ("apikey", "accesskey", "secretkey", "privatekey", "accesstoken", "refreshtoken",
                 "authtoken", "sastoken", "sessiontoken", "connectionstring", "clientsecret",
                 "accesskeyid", "password", "passphrase", "passwd")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


def is_secret_key(key: Any) -> bool:
    """Whether a config key (or a URI query parameter) names a secret. A count such as
    `max_tokens` is not one: the match is on whole last words, `tokens` is not `token`."""
    words = [w.lower() for w in _WORD.findall(str(key))]
    if not words:
        return False
    if words[-1] in _SECRET_WORDS or tuple(words[-2:]) in _SECRET_PAIRS:
        return True
    return "".join(words).endswith(_SECRET_TAILS)


_URI = re.compile(r"\b([A-Za-z][A-Za-z0-9+.\-]*://)([^\s\"'<>]*)")


def _redact_uri(scheme: str, rest: str) -> str:
    end = min([i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0] or [len(rest)])
    authority = rest[:end]
    if "@" in authority:  # user:password@host -> ***@host
        rest = f"{URI_SECRET}@{rest[authority.rindex('@') + 1:]}"
    if "?" in rest:  # presigned URLs: X-Amz-Signature=..., sig=..., token=...
        base, _, query = rest.partition("?")
        query, hash_, frag = query.partition("#")
        parts = []
        for p in query.split("&"):
            name, eq, _value = p.partition("=")
            parts.append(f"{name}={URI_SECRET}" if eq and is_secret_key(unquote(name)) else p)
        rest = f"{base}?{'&'.join(parts)}{hash_}{frag}"
    return scheme + rest


def redact_text(text: Any) -> Any:
    """`text` with the credentials inside every URI in it replaced: `https://user:pass@host/x`
    -> `https://***@host/x`, and secret query parameters (`X-Amz-Signature`, `X-Amz-Credential`,
    `sig`, `token`, ...) -> `name=***`. Anything that is not a str comes back unchanged."""
    if not isinstance(text, str) or "://" not in text:
        return text
    return _URI.sub(lambda m: _redact_uri(m.group(1), m.group(2)), text)


def redact_strings(obj: Any) -> Any:
    """Copy of a nested structure with `redact_text` applied to every string in it (keys kept):
    for manifests, whose facts may quote a path or an error."""
    if isinstance(obj, dict):
        return {k: redact_strings(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_strings(v) for v in obj]
    return redact_text(obj)
