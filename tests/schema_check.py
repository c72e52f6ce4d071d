"""The JSON schemas the structured-output tests use, and a small validator for the keywords they
use (type, properties, required, additionalProperties false, enum, pattern, maxLength, minimum,
maximum, items, minItems, maxItems): ``jsonschema`` is not a dependency of this project."""

from __future__ import annotations

import re

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {
        "type": "object",
        "properties": {
            "fruits": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}
        },
        "required": ["fruits"],
    },
    {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "country": {"type": "string", "maxLength": 20},
                },
                "required": ["name", "country"],
            }
        },
        "required": ["city"],
    },
    {
        "type": "object",
        "properties": {
            "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
            "unit": {"enum": ["C", "F"]},
            "ok": {"type": "boolean"},
        },
        "required": ["temperature", "unit", "ok"],
    },
]
PROMPTS = [
    "Give a person's name and age as JSON.",
    "Pick a color. Answer in JSON.",
    "List up to three fruits as JSON.",
    "Name a city and its country as JSON.",
    "Report today's temperature as JSON.",
]

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def violations(value, schema: dict, path: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (empty: valid)."""
    errors = []
    kind = schema.get("type")
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{path}: not an integer"]
    elif kind == "number":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return [f"{path}: not a number"]
    elif kind is not None and not isinstance(value, _TYPES[kind]):
        return [f"{path}: not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(f"{path}: longer than {schema['maxLength']}")
    if "minimum" in schema and value < schema["minimum"] or "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: {value} out of range")
    if kind == "array":
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            errors.append(f"{path}: {len(value)} items")
        for i, item in enumerate(value):
            errors += violations(item, schema.get("items", {}), f"{path}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        errors += [f"{path}: missing {k}" for k in schema.get("required", []) if k not in value]
        errors += [f"{path}: unexpected {k}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += violations(v, props[k], f"{path}.{k}")
    return errors
