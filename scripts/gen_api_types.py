"""Write the Lab extension's TypeScript types of the REST API from the server's OpenAPI document.

    PYTHONPATH=. python scripts/gen_api_types.py          # writes labextension/src/generated/api-types.ts
    PYTHONPATH=. python scripts/gen_api_types.py --check  # exit 1 when the committed file is stale

One `export interface I<Schema>` per schema of `components.schemas` (the pydantic models), so the
panel's record, ledger and queue types cannot drift from the server's. tests/test_api_types.py
regenerates in memory and compares with the committed file. Standard library and the package only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "labextension" / "src" / "generated" / "api-types.ts"

HEADER = """\
/**
 * The types of the jupyter_evalsched REST API, generated from the server's OpenAPI document
 * (jupyter_evalsched/openapi.py, built from its pydantic models).
 *
 * DO NOT EDIT: run `PYTHONPATH=. python scripts/gen_api_types.py` from the repository root.
 * tests/test_api_types.py fails when this file is stale.
 */
"""


def _name(ref: str) -> str:
    """`#/components/schemas/RunRecord` -> `IRunRecord` (the extension's interface naming)."""
    return "I" + ref.rsplit("/", 1)[-1]


def _literal(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False).replace('"', "'") if isinstance(value, str) else json.dumps(value)


def _union(types: list[str]) -> str:
    seen: list[str] = []
    for t in types:
        if t not in seen:
            seen.append(t)
    # `null` last, as the hand-written types put it.
    seen.sort(key=lambda t: t == "null")
    return " | ".join(seen) if seen else "unknown"


def ts_type(schema: Any, indent: str = "") -> str:
    """The TypeScript type of a JSON schema (the subset pydantic writes)."""
    if schema is True or schema == {}:
        return "unknown"
    if "$ref" in schema:
        return _name(schema["$ref"])
    if "const" in schema:
        return _literal(schema["const"])
    if "enum" in schema:
        return _union([_literal(v) for v in schema["enum"]])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return _union([part for s in schema[key] for part in ts_type(s, indent).split(" | ")])
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return ts_type(schema["allOf"][0], indent)
    kind = schema.get("type")
    if isinstance(kind, list):
        return _union([ts_type({**schema, "type": k}, indent) for k in kind])
    if kind == "string":
        return "string"
    if kind in ("integer", "number"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "null":
        return "null"
    if kind == "array":
        if "prefixItems" in schema:
            return "[" + ", ".join(ts_type(s, indent) for s in schema["prefixItems"]) + "]"
        return _wrap(ts_type(schema.get("items", {}), indent)) + "[]"
    if kind == "object" or "properties" in schema:
        if schema.get("properties"):
            return _object(schema, indent)
        extra = schema.get("additionalProperties", True)
        return f"{{ [key: string]: {ts_type(extra, indent)} }}"
    return "unknown"


def _wrap(t: str) -> str:
    """Parenthesise a union before `[]`."""
    return f"({t})" if " | " in t and not t.startswith("{") else t


def _doc(text: str | None, indent: str) -> list[str]:
    if not text:
        return []
    lines = [line.rstrip() for line in text.replace("*/", "*\\/").splitlines()]
    if len(lines) == 1:
        return [f"{indent}/** {lines[0]} */"]
    return [f"{indent}/**", *(f"{indent} * {line}".rstrip() for line in lines), f"{indent} */"]


def _object(schema: dict, indent: str, sent: bool = False) -> str:
    inner = indent + "  "
    required = set(schema.get("required", []))
    lines = ["{"]
    for prop, sub in schema.get("properties", {}).items():
        lines += _doc(sub.get("description"), inner)
        key = prop if prop.isidentifier() else json.dumps(prop)
        # What the server sends always carries its defaults; what a client sends may leave them out.
        optional = "" if prop in required or (sent and "default" in sub) else "?"
        lines.append(f"{inner}{key}{optional}: {ts_type(sub, inner)};")
    extra = schema.get("additionalProperties")
    if extra:
        lines.append(f"{inner}[key: string]: unknown;")
    lines.append(f"{indent}}}")
    return "\n".join(lines)


def _refs(node: Any) -> set[str]:
    """The schema names a part of the document refers to."""
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[-1]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def request_schemas(document: dict) -> set[str]:
    """The schemas of request bodies, and those they refer to: what clients send."""
    schemas = document.get("components", {}).get("schemas", {})
    bodies = [
        op.get("requestBody", {})
        for path in document.get("paths", {}).values()
        for op in path.values()
        if isinstance(op, dict)
    ]
    todo, seen = _refs(bodies), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo |= _refs(schemas.get(name, {}))
    return seen


def render(document: dict) -> str:
    """The TypeScript module of a document's `components.schemas`, in name order."""
    schemas = document.get("components", {}).get("schemas", {})
    requests = request_schemas(document)
    out = [HEADER]
    for name in sorted(schemas):
        schema = schemas[name]
        doc = _doc(schema.get("description"), "")
        if schema.get("type") == "object" or "properties" in schema:
            body = _object(schema, "", sent=name not in requests)
            out.append("\n".join([*doc, f"export interface I{name} {body}"]) + "\n")
        else:
            out.append("\n".join([*doc, f"export type I{name} = {ts_type(schema)};"]) + "\n")
    return "\n".join(out)


def generate() -> str:
    """The file's content, from the package's OpenAPI document."""
    from jupyter_evalsched.openapi import openapi_document

    return render(openapi_document())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed file is stale")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT.relative_to(REPO)} is stale: run scripts/gen_api_types.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
