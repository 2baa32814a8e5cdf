"""Who is calling and what they may do: the inference keys, the admin key and the admin routes' gate, the owner
every request, request id and stored response belongs to, and the directories admin routes may load from.

Keys. Inference keys (``--api-key``, repeatable; ``--api-key-file``; ``DUALPATH_API_KEY``) let a client generate,
read its own stored responses and abort its own requests; with none, every client is one anonymous owner. The admin
key (``--admin-api-key``, ``DUALPATH_ADMIN_API_KEY``) differs from every inference key; it may do what an inference
key may, and the admin routes need it. A presented key is compared with the configured ones in constant time
(``hmac.compare_digest`` over SHA-256 digests, every inference key each time: the time taken says nothing of how
much of a key matched, nor how long any is).

Owners. A caller's owner is a tag of its key (``key_tag``: a truncated SHA-256, never the key; "" for the anonymous
owner). A request's name at the scheduler (SGLang's ``rid``, else its X-Request-Id) is put in its owner's namespace
(``owned_label``), so ``/abort_request`` by rid ends only the caller's own requests of that name, whichever frontend
they came through (frontends given the same keys derive the same tags); an admin's ends every owner's. Stored
responses record their owner and are not found (404) by any other.

Admin routes (weight updates, adapters, cache flushes, pauses, server-wide aborts) are off unless the server runs with
``--enable-admin-api`` (vLLM's ``VLLM_SERVER_DEV_MODE=1``; adapters alone: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):
a 403 naming the flag. On, they need the admin key (401 without a valid key, 403 with an inference key). A server
given no admin key serves them only when it binds loopback alone and the request's Host names loopback (a web page
that rebinds its own name to 127.0.0.1 still sends its name), and to an inference key's holder where keys are set;
anywhere else a 403 says to set one.

Paths. Weight updates and adapters load only from under ``--allowed-model-dirs`` (default: the directories holding
the served model and its ``--lora-modules`` adapters), both sides resolved with ``os.path.realpath`` (``..`` and
symbolic links followed first); a path elsewhere is a 400 naming that rule, whether or not it exists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass
from typing import Iterable

from dualpath.core.errors import ConfigError
from dualpath.serving.choices import ApiError

ANONYMOUS = ""  # the owner of every request on a server without inference keys
ADMIN, LORA = "admin", "lora"  # groups of admin routes; LORA's (adapters) alone are on with vLLM's LoRA variable
SECRETS = ("api_key", "api_keys", "admin_api_key")  # the frontend's settings no response shows
GROUP_FLAGS = {
    ADMIN: "--enable-admin-api (or VLLM_SERVER_DEV_MODE=1)",  # what a disabled route's 403 names
    LORA: "--enable-admin-api (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
}


@dataclass(frozen=True)
class Caller:
    owner: str  # ``key_tag`` of the caller's key; ANONYMOUS on a server without inference keys
    admin: bool = False  # may use the admin routes that are on


def key_tag(key: str) -> str:
    """A key's owner tag: what logs, stored responses and the scheduler's labels hold instead of the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def owned_label(owner: str, name: str) -> str:
    """The name the scheduler knows a request by (what ``/abort_request`` matches): the client's, in its owner's
    namespace. The anonymous owner's names are the clients' own."""
    return f"{owner}:{name}" if owner and name else name


def checked_keys(keys: Iterable[str | None], admin_key: str | None) -> tuple[str, ...]:
    """The distinct inference keys; ``ConfigError`` if the admin key is one of them (it would make every holder of
    that key an admin)."""
    kept = tuple(dict.fromkeys(k for k in keys if k))
    if admin_key and admin_key in kept:
        raise ConfigError("the admin API key must differ from every inference API key")
    return kept


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name, without port) is this machine's loopback only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a Host header (``[::1]:8000`` -> ``::1``, ``127.0.0.1:8000`` -> ``127.0.0.1``)."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode()).digest()


class Auth:
    """The one place requests are identified (``caller``) and admin routes gated (``admin``)."""

    def __init__(
        self,
        keys: Iterable[str | None],
        admin_key: str | None = None,
        admin_groups: Iterable[str] = (),
        loopback_only: bool = False,
    ):
        self._keys = tuple((_digest(k), key_tag(k)) for k in checked_keys(keys, admin_key))
        self._admin = (_digest(admin_key), key_tag(admin_key)) if admin_key else None
        self.groups, self.loopback_only = frozenset(admin_groups), loopback_only

    @property
    def inference_keys(self) -> int:
        return len(self._keys)

    def caller(self, request) -> Caller:
        """Who sent ``request`` (kept in its state: checked once); a 401 for a missing or unknown key where keys
        are set."""
        known = getattr(request.state, "caller", None)
        if known is None:
            known = request.state.caller = self._identify(_bearer(request))
        return known

    def _identify(self, token: bytes | None) -> Caller:
        if token is not None:
            given = _digest(token)
            if self._admin is not None and hmac.compare_digest(given, self._admin[0]):
                return Caller(self._admin[1], admin=True)
            matched = [tag for digest, tag in self._keys if hmac.compare_digest(given, digest)]  # no early exit
            if matched:
                return Caller(matched[0])
        if not self._keys:
            return Caller(ANONYMOUS)
        raise ApiError(
            401,
            "missing or invalid API key (send 'Authorization: Bearer <key>')",
            "invalid_request_error",
            None,
            "invalid_api_key",
        )

    def admin(self, request, group: str = ADMIN) -> Caller:
        """The caller of an admin route of ``group``, or the ``ApiError`` that refuses it (see the module's
        docstring)."""
        if group not in self.groups:
            raise ApiError(
                403,
                f"{request.url.path} is an admin route, off unless the server runs with {GROUP_FLAGS[group]}",
                code="admin_api_disabled",
            )
        caller = self.caller(request)
        if caller.admin:
            return caller
        if self._admin is None:
            if self.loopback_only and is_loopback(_host_name(request.headers.get("host", ""))):
                return dataclasses.replace(caller, admin=True)
            raise ApiError(
                403,
                "admin routes need an admin key (--admin-api-key, or DUALPATH_ADMIN_API_KEY) unless "
                "the server binds loopback only and is asked by a loopback name",
                code="admin_key_required",
            )
        if caller.owner == ANONYMOUS:
            raise ApiError(
                401,
                "missing or invalid admin API key (send 'Authorization: Bearer <admin key>')",
                code="invalid_api_key",
            )
        raise ApiError(403, "this route needs the admin API key, not an inference key", code="admin_key_required")

    def is_admin(self, request, group: str = ADMIN) -> bool:
        try:
            return self.admin(request, group).admin
        except ApiError:
            return False

    def owners(self) -> tuple[str, ...]:
        """Every owner a request may have here (an admin's abort by rid ends each one's of that name)."""
        return (
            ((ANONYMOUS,) if not self._keys else ())
            + tuple(tag for _, tag in self._keys)
            + ((self._admin[1],) if self._admin else ())
        )


def _bearer(request) -> bytes | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None


def allowed_dirs(given: Iterable[str], model_dir: str, adapter_dirs: Iterable[str]) -> tuple[str, ...]:
    """``--allowed-model-dirs`` resolved; none given: the directories holding the model and its adapters (a
    checkpoint beside the served one, as an RL run writes them, loads; one elsewhere does not)."""
    roots = tuple(given) or (
        os.path.dirname(os.path.realpath(model_dir)),
        *(os.path.dirname(os.path.realpath(d)) for d in adapter_dirs),
    )
    return tuple(dict.fromkeys(os.path.realpath(r) for r in roots))


def confined(path: str, roots: tuple[str, ...], field: str) -> str:
    """``path`` resolved (``..`` and symbolic links followed) if it lies under one of ``roots``; else a 400 naming
    the rule, the same whether or not the path exists."""
    try:
        real = os.path.realpath(path)
    except (ValueError, OSError):  # a NUL byte, a loop of links
        real = None
    if real is not None and any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
        return real
    raise ApiError(400, f"{field} must be under one of the --allowed-model-dirs", param=field)
