"""Extract the OpenAI component schemas the serving tests validate against (and everything they reference) from
the OpenAI API's published OpenAPI description, into openai_schemas.json (MIT license: OPENAI_LICENSE).

    python tests/data/extract_openai_schemas.py ../shared/openai-openapi/openapi.json
"""

import json
import sys
from pathlib import Path

ROOTS = [
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "ErrorResponse",
    "Response",
    "ResponseItemList",
] + [
    f"Response{e}Event"
    for e in (
        "Completed",
        "ContentPartAdded",
        "ContentPartDone",
        "Created",
        "Failed",
        "FunctionCallArgumentsDelta",
        "FunctionCallArgumentsDone",
        "InProgress",
        "Incomplete",
        "OutputItemAdded",
        "OutputItemDone",
        "TextDelta",
        "TextDone",
        "ReasoningTextDelta",
        "ReasoningTextDone",
    )
]


def refs(node, out):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            out.add(ref.rsplit("/", 1)[1])
        for v in node.values():
            refs(v, out)
    elif isinstance(node, list):
        for v in node:
            refs(v, out)


def main(path):
    schemas = json.loads(Path(path).read_text())["components"]["schemas"]
    keep, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        found = set()
        refs(schemas[name], found)
        todo.extend(found - keep)
    out = {
        "source": "openai/openai-openapi (commit f85dbe2), MIT license: see OPENAI_LICENSE",
        "components": {"schemas": {k: schemas[k] for k in sorted(keep)}},
    }
    (Path(__file__).parent / "openai_schemas.json").write_text(json.dumps(out, indent=1, sort_keys=True))
    print(f"{len(keep)} schemas")


if __name__ == "__main__":
    main(sys.argv[1])
