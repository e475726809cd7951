"""Pages of the user guide written at build time, offline, from the package itself.

A page holds a marker (an HTML comment on a line of its own); when Sphinx reads the page, the
marker is replaced with MyST markdown:

* ``<!-- evalsched:openapi -->``: every path and method of ``openapi_document()`` (summary,
  parameters, request body, responses with their schemas' names), then every schema's fields;
* ``<!-- evalsched:cli -->``: the help of ``jupyter evalsched`` and of each of its commands, from
  ``build_parser()``;
* ``<!-- evalsched:panel-screenshot -->``: the panel's screenshot if ``_static/panel.png``
  exists (the browser tests write it when ``EVALSCHED_DOC_SCREENSHOTS`` names that folder), else
  a line saying how to make it. Never a warning either way.

The pages with a marker are read again at every build, so that they follow the code and the
screenshot.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

MARKERS = {
    "openapi": "<!-- evalsched:openapi -->",
    "cli": "<!-- evalsched:cli -->",
    "panel-screenshot": "<!-- evalsched:panel-screenshot -->",
}
METHODS = ("get", "post", "put", "patch", "delete")


# -- the REST API -----------------------------------------------------------------------------


def _cell(text: Any) -> str:
    """Text for a markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _schema_ref(name: str) -> str:
    return f"{{ref}}`{name} <schema-{name.lower()}>`"


def schema_type(schema: dict[str, Any]) -> str:
    """A short, readable type of a JSON schema: `RunRecord`, `string or null`, `array of string`."""
    if "$ref" in schema:
        return _schema_ref(schema["$ref"].rsplit("/", 1)[-1])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(schema_type(part) for part in schema[key])
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return schema_type(schema["allOf"][0])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " or ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        items = schema.get("items")
        return f"array of {schema_type(items)}" if isinstance(items, dict) and items else "array"
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            return f"object of {schema_type(extra)}"
        return "object"
    return kind or "any"


def _constraints(schema: dict[str, Any]) -> str:
    parts = []
    for key, label in (
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("maxItems", "items ≤"),
    ):
        if key in schema:
            parts.append(f"{label} {schema[key]}")
    if "pattern" in schema:
        parts.append(f"pattern `{schema['pattern']}`")
    for part in schema.get("anyOf", []):
        inner = _constraints(part)
        if inner:
            parts.append(inner)
    return ", ".join(parts)


def _default(schema: dict[str, Any]) -> str:
    return f"`{json.dumps(schema['default'])}`" if "default" in schema else ""


def _describe(schema: dict[str, Any], description: str = "") -> str:
    """The description, then the limits (`≥ 1, ≤ 256`), as one table cell."""
    text = " ".join((description or schema.get("description", "")).split())
    limits = _constraints(schema)
    if text and limits:
        return _cell(f"{text.rstrip('.')}; {limits}")
    return _cell(text or limits)


def _content_schema(body: dict[str, Any]) -> str:
    content = body.get("content") or {}
    out = []
    for media, spec in content.items():
        schema = spec.get("schema") or {}
        out.append(f"{schema_type(schema)} (`{media}`)")
    return "; ".join(out) or "—"


def openapi_markdown(document: dict[str, Any]) -> str:
    prefix = (document.get("servers") or [{"url": ""}])[0]["url"].rstrip("/")
    info = document.get("info", {})
    lines = [
        f"Generated from the OpenAPI {document.get('openapi')} document of version {info.get('version')} "
        f"(`GET {prefix}/openapi.json` on a running server serves the same document, with the "
        "server's base URL). Paths are relative to the server's base URL. "
        f"{_cell(info.get('description', ''))}",
        "",
        "## Endpoints",
        "",
        "| method | path | summary |",
        "|---|---|---|",
    ]
    operations = []
    for path, item in document["paths"].items():
        for method in METHODS:
            if method in item:
                operations.append((path, method, item, item[method]))
    for path, method, _item, op in operations:
        lines.append(f"| {method.upper()} | `{prefix}{path}` | {_cell(op.get('summary', ''))} |")
    lines.append("")
    for path, method, item, op in operations:
        lines += ["", f"### `{method.upper()} {prefix}{path}`", ""]
        if op.get("summary"):
            lines += [_cell(op["summary"]) + ".", ""]
        if op.get("description"):
            lines += [op["description"].strip(), ""]
        if op.get("operationId"):
            lines += [f"Operation id: `{op['operationId']}`.", ""]
        params = [*item.get("parameters", []), *op.get("parameters", [])]
        if params:
            lines += ["| parameter | in | type | required | default | description |", "|---|---|---|---|---|---|"]
            for param in params:
                schema = param.get("schema") or {}
                lines.append(
                    f"| `{param['name']}` | {param.get('in', '')} | {_cell(schema_type(schema))} | "
                    f"{'yes' if param.get('required') else 'no'} | {_cell(_default(schema))} | "
                    f"{_describe(schema, param.get('description', ''))} |"
                )
            lines.append("")
        body = op.get("requestBody")
        if body:
            required = " (required)" if body.get("required") else ""
            lines += [f"Request body{required}: {_content_schema(body)}.", ""]
        responses = op.get("responses") or {}
        if responses:
            lines += ["| status | description | body |", "|---|---|---|"]
            for code, response in responses.items():
                lines.append(
                    f"| {code} | {_cell(response.get('description', ''))} | {_cell(_content_schema(response))} |"
                )
            lines.append("")
    schemas = (document.get("components") or {}).get("schemas") or {}
    lines += ["", "## Schemas", "", "The models behind the bodies above (generated from the pydantic models).", ""]
    for name, schema in schemas.items():
        lines += [f"(schema-{name.lower()})=", f"### {name}", ""]
        if schema.get("description"):
            lines += [" ".join(schema["description"].split()), ""]
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        if properties:
            lines += ["| field | type | required | default | description |", "|---|---|---|---|---|"]
            for field, spec in properties.items():
                lines.append(
                    f"| `{field}` | {_cell(schema_type(spec))} | {'yes' if field in required else 'no'} | "
                    f"{_cell(_default(spec))} | {_describe(spec)} |"
                )
            lines.append("")
        else:
            lines += [f"Type: {schema_type(schema)}.", ""]
    return "\n".join(lines)


# -- the CLI ----------------------------------------------------------------------------------


def cli_markdown(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: make it fixed
    try:
        lines = [
            f"Generated from the `{parser.prog}` parser. Every command takes `--url`, `--token` and "
            "`--json`, before or after the command.",
            "",
            f"## `{parser.prog}`",
            "",
            "```text",
            parser.format_help().rstrip(),
            "```",
        ]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    lines += ["", f"## `{parser.prog} {name}`", "", "```text", sub.format_help().rstrip(), "```"]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(lines)


# -- the screenshot ---------------------------------------------------------------------------


def screenshot_markdown(srcdir: Path) -> str:
    if (srcdir / "_static" / "panel.png").is_file():
        return "\n".join(
            [
                "```{figure} _static/panel.png",
                ":alt: The jupyter_evalsched side panel in JupyterLab",
                ":width: 420px",
                "",
                "The panel during a run of the browser tests: two virtual 24000 MB GPUs holding a "
                "lease, a run and a sweep's two runs, each labelled in its bar and its legend; a "
                "run queued behind them with its `waiting_vram` reason; finished runs and a sweep.",
                "```",
            ]
        )
    return (
        "*(No screenshot in this build: the browser tests write it. Run "
        "`EVALSCHED_DOC_SCREENSHOTS=docs/_static .venv/bin/python -m pytest tests/test_lab_layout.py`, "
        "then build the docs again.)*"
    )


# -- Sphinx -----------------------------------------------------------------------------------


def _generate(kind: str, srcdir: Path) -> str:
    if kind == "openapi":
        from jupyter_evalsched.openapi import openapi_document

        return openapi_markdown(openapi_document())
    if kind == "cli":
        from jupyter_evalsched.cli import build_parser

        return cli_markdown(build_parser())
    return screenshot_markdown(srcdir)


def _source_read(app: Any, docname: str, source: list[str]) -> None:
    for kind, marker in MARKERS.items():
        if marker in source[0]:
            source[0] = source[0].replace(marker, _generate(kind, Path(app.srcdir)))


def _outdated(app: Any, env: Any, added: set[str], changed: set[str], removed: set[str]) -> list[str]:
    """The generated pages follow the code and the screenshot: read them again every time."""
    again = []
    for docname in sorted(env.found_docs - removed - added - changed):
        path = Path(env.doc2path(docname))
        if path.suffix == ".md" and any(m in path.read_text(encoding="utf-8") for m in MARKERS.values()):
            again.append(docname)
    return again


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _source_read)
    app.connect("env-get-outdated", _outdated)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
