"""Request bodies read as JSON and validated strictly, with errors that name the field (``RequestError``), and
OpenAI's error body."""

from __future__ import annotations

import json
from typing import Any, Optional

from pydantic import ValidationError

from dualpath.core.errors import RequestError


def parse(model_cls, body: bytes):
    """Parse and validate a request body; raise ``RequestError`` naming the offending field."""
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            raise RequestError("the body must be a JSON object")
        _check_unicode(data, ())
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("the body nests too deeply") from None
    return validated(model_cls, data)


def validated(model_cls, data: dict, names: Optional[dict[str, str]] = None):
    """``data`` (decoded JSON) as a ``model_cls`` request, every field strictly typed as OpenAI's API types it: a
    boolean is no number (``max_tokens: true`` is not 1), a number no boolean, a string neither, ``5.0`` no integer;
    an integer is a valid float. A ``RequestError`` names the first offending field (as ``names`` calls it: another
    API's name)."""
    try:
        return model_cls.model_validate(data, strict=True)  # strict reaches every nested model too
    except RecursionError:
        raise RequestError("the body nests too deeply") from None
    except ValidationError as e:
        err = e.errors()[0]
        loc = [(names or {}).get(str(x), str(x)) if i == 0 else str(x) for i, x in enumerate(err["loc"])]
        raise RequestError(f"{'.'.join(loc) or 'body'}: {err['msg']}", field=loc[0] if loc else None) from None


def _check_unicode(node, where: tuple) -> None:
    """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer can encode: name where it is."""
    if isinstance(node, str):
        try:
            node.encode("utf-8")
        except UnicodeEncodeError:
            loc = ".".join(map(str, where)) or "body"
            raise RequestError(
                f"{loc}: invalid Unicode (a lone surrogate)", field=str(where[0]) if where else None
            ) from None
    elif isinstance(node, dict):
        for k, v in node.items():
            _check_unicode(k, where)
            _check_unicode(v, where + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_unicode(v, where + (i,))


def error_body(message: str, type_: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
