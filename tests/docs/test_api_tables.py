"""docs/api.md's tables are the server's: its endpoint table lists exactly the routes the FastAPI app registers, and
each request-field table (marked ``<!-- fields: NAME -->``, in docs/api.md and docs/rollouts.md) lists exactly the
fields of its request model, each with a status (supported, 400, ignored); the fields marked 400 are refused, and
those marked ignored are accepted and change nothing. The app is the tests' own: a frontend over a scripted cluster
(``tests/serving/test_tools.py``'s ``serve``)."""

import re
import sys
import warnings

import pytest
from fastapi.routing import APIRoute

from doc_blocks import DOCS, ROOT

sys.path.insert(0, str(ROOT / "tests" / "serving"))
from test_tools import HERMES_TEMPLATE, serve  # noqa: E402

from dualpath.serving import native, protocol, responses  # noqa: E402

API = DOCS / "api.md"
STATUSES = ("supported", "400", "ignored")
TABLE_PAGES = (DOCS / "api.md", DOCS / "rollouts.md")


def names(model) -> set[str]:
    return {f.alias or n for n, f in model.model_fields.items()}


FIELDS = {
    "common": names(protocol._Common),
    "chat": names(protocol.ChatRequest) - names(protocol._Common),
    "completions": names(protocol.CompletionRequest) - names(protocol._Common),
    "responses": names(responses.ResponsesRequest) | set(responses.PASSTHROUGH),
    "tokenize": names(protocol.TokenizeRequest),
    "detokenize": names(protocol.DetokenizeRequest),
    "update_weights": names(protocol.UpdateWeightsRequest),
    "load_lora": names(protocol.LoadLoraRequest),
    "unload_lora": names(protocol.UnloadLoraRequest),
    "abort": names(protocol.AbortRequest),
    "pause_generation": names(protocol.PauseGenerationRequest),
    "generate": names(native.GenerateRequest),
    "generate.sampling_params": set(native.RENAMED) | native.ALIKE | native.IGNORED,
}


def rows(text: str) -> list[list[str]]:
    """A markdown table's body rows as cells (the header and the rule left out)."""
    out = []
    for line in text.split("\n"):
        if not line.startswith("|"):
            if out:
                break
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        out.append(cells)
    return out[2:]


def field_tables() -> dict[str, list[tuple[set[str], str]]]:
    """Each marked table: (the field names its first cell gives, its status) per row."""
    out: dict[str, list[tuple[set[str], str]]] = {}
    for page in TABLE_PAGES:
        text = page.read_text()
        for m in re.finditer(r"<!-- fields: ([\w.]+) -->\n", text):
            assert m.group(1) not in out, f"two tables for {m.group(1)}"
            out[m.group(1)] = [(set(re.findall(r"`([\w.]+)`", cells[0])), cells[1]) for cells in rows(text[m.end() :])]
    return out


def endpoint_table() -> set[tuple[str, str]]:
    """(method, path) of every row of the endpoint table, path parameters as ``{}``."""
    out = set()
    for cells in rows(API.read_text().split("## Endpoints", 1)[1]):
        for method in re.findall(r"`([A-Z]+)`", cells[0]):
            out.add((method, re.sub(r"\{[^}]*\}", "{}", cells[1].strip("`"))))
    return out


@pytest.fixture(scope="module")
def app(tiny_dirs, tmp_path_factory):
    http, fake, tok = serve(tiny_dirs, tmp_path_factory.mktemp("api-doc"), HERMES_TEMPLATE)
    fake.reply = "ok"
    return http, fake


def registered(app) -> set[tuple[str, str]]:
    """(method, path) of every route ``app`` serves: those in its OpenAPI schema (every route of its routers,
    however this FastAPI nests included routers) and those outside it (``/openapi.json`` itself)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (/ping's GET and POST share an operation id)
        schema = app.openapi()
    out = {
        (method.upper(), path)
        for path, ops in schema["paths"].items()
        for method in ops
        if method.upper() in ("GET", "POST", "PUT", "PATCH", "DELETE")
    }
    out |= {
        (m, r.path)
        for r in app.routes
        if not isinstance(r, APIRoute) and getattr(r, "methods", None)
        for m in r.methods
    }
    return {(m, re.sub(r"\{[^}]*\}", "{}", p)) for m, p in out if m != "HEAD"}


def test_the_endpoint_table_lists_every_route_the_app_registers(app):
    http, _ = app
    routes = registered(http.app)
    assert len(routes) > 30
    documented = endpoint_table()
    assert not routes - documented, f"routes missing from docs/api.md: {sorted(routes - documented)}"
    assert not documented - routes, f"docs/api.md lists routes the app lacks: {sorted(documented - routes)}"


def test_every_request_field_is_in_its_table_with_a_status():
    tables = field_tables()
    assert set(tables) == set(FIELDS), "a table per request model, marked <!-- fields: NAME -->"
    for name, expected in FIELDS.items():
        listed, bad = set(), []
        for fields, status in tables[name]:
            if not status.startswith(STATUSES):
                bad.append(f"{sorted(fields)}: status {status!r}")
            if not status.startswith("ignored") and fields - expected:
                bad.append(f"{sorted(fields - expected)} are no fields of the request")
            listed |= fields
        assert not expected - listed, f"{name}: fields missing from the table: {sorted(expected - listed)}"
        assert not bad, f"{name}: " + "; ".join(bad)


# A value that asks for what a field marked 400 cannot give (refused whatever the template and model).
REFUSING = {
    "use_beam_search": True,
    "length_penalty": 2.0,
    "logits_processors": ["x"],
    "chat_template": "{{ messages }}",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "modalities": ["audio"],
    "echo": True,
    "add_special_tokens": True,
    "suffix": "x",
    "background": True,
    "conversation": "conv_1",
    "prompt": {"id": "pmpt_1"},
}
BODIES = {
    "common": (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    ),
    "chat": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4}),
    "responses": ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 4}),
}


def test_the_fields_marked_400_are_refused_naming_themselves(app):
    http, _ = app
    tables, checked = field_tables(), 0
    for name, (path, body) in BODIES.items():
        for fields, status in tables[name]:
            if not status.startswith("400"):
                continue
            for field in fields:
                assert field in REFUSING, f"{name}.{field} is marked 400: give REFUSING a value it refuses"
                r = http.post(path, json={**body, field: REFUSING[field]})
                assert r.status_code == 400, (name, field, r.status_code, r.text)
                err = r.json()["error"]
                assert field in (err["param"] or "") + err["message"], (name, field, err)
                checked += 1
    assert checked >= 12


def test_the_fields_marked_ignored_change_nothing(app):
    http, fake = app
    tables = field_tables()
    for name, (path, body) in BODIES.items():
        ignored = {f for fields, status in tables[name] if status.startswith("ignored") for f in fields}
        if not ignored:
            continue
        assert http.post(path, json=body).status_code == 200
        plain = fake.samplings[-1]
        for field in ignored:
            r = http.post(path, json={**body, field: "x"})
            assert r.status_code == 200, (name, field, r.text)
            assert fake.samplings[-1] == plain, (name, field)
