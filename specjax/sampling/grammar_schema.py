"""JSON schemas for `Grammar.from_json_schema`: checked, then turned into outlines-core's regex.

A schema is refused before anything compiles, with a ValueError naming the field, when it is not
JSON, not a valid schema (jsonschema's metaschema check, naming the failing keyword's path), or
uses a construct outlines-core 0.2.14 cannot enforce. That last check matters because
outlines-core silently ignores several keywords (its regex for `{"type": "integer", "minimum":
3}` is any integer), so an output could match the grammar yet fail validation; every keyword
in IGNORED is refused, naming it and where it sits, as is `oneOf` (compiled as anyOf: an output
may match two branches) and an `allOf` of several schemas (not merged). Annotations (title,
description, examples, ...) are fine.
"""

from __future__ import annotations

import json

IGNORED = (
    'minimum', 'maximum', 'exclusiveMinimum', 'exclusiveMaximum', 'multipleOf',
    'minProperties', 'maxProperties', 'patternProperties', 'propertyNames',
    'dependentRequired', 'dependentSchemas', 'dependencies', 'unevaluatedProperties',
    'unevaluatedItems', 'uniqueItems', 'contains', 'minContains', 'maxContains', 'not', 'if',
    'then', 'else',
)  # fmt: skip
_SUBSCHEMA_MAPS = ('properties', '$defs', 'definitions')
_SUBSCHEMA_LISTS = ('anyOf', 'allOf', 'prefixItems')
_SUBSCHEMAS = ('items', 'additionalProperties')


def schema_regex(schema) -> tuple[str, str]:
    """(the schema as JSON text, outlines-core's regex for it); ValueError naming the problem."""
    from outlines_core.json_schema import build_regex_from_schema  # noqa: PLC0415

    text, parsed = _parse(schema)
    _check_metaschema(parsed)
    unsupported(parsed)
    try:
        return text, build_regex_from_schema(text)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f'Grammar.from_json_schema: schema uses a construct outlines-core cannot compile: '
            f'{str(e).strip().splitlines()[0]}'
        ) from e


def _parse(schema) -> tuple[str, object]:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f'Grammar.from_json_schema: schema is not valid JSON: {e}') from e
    elif isinstance(schema, dict):
        parsed = schema
    else:
        raise ValueError(
            f'Grammar.from_json_schema: schema must be a JSON string or a dict, got '
            f'{type(schema).__name__}'
        )
    if not isinstance(parsed, dict):
        raise ValueError(f'Grammar.from_json_schema: schema must be an object, got {parsed!r}')
    return json.dumps(parsed), parsed


def _check_metaschema(parsed) -> None:
    import jsonschema  # noqa: PLC0415

    try:
        jsonschema.validators.validator_for(parsed).check_schema(parsed)
    except jsonschema.SchemaError as e:
        where = '/'.join(str(p) for p in e.path) or '(root)'
        raise ValueError(
            f'Grammar.from_json_schema: invalid schema at {where}: {e.message}'
        ) from None


def unsupported(schema, path: str = 'schema') -> None:
    """ValueError naming the first construct outlines-core would not enforce (depth first)."""
    if not isinstance(schema, dict):
        return
    for key in IGNORED:
        if key in schema:
            raise ValueError(
                f'Grammar.from_json_schema: {path} uses {key!r}, which outlines-core does not '
                'enforce (its output could fail validation); drop it or check it after decoding'
            )
    if 'oneOf' in schema:
        raise ValueError(
            f"Grammar.from_json_schema: {path} uses 'oneOf', which outlines-core compiles as "
            "'anyOf' (an output may match several branches); write anyOf if that is meant"
        )
    if len(schema.get('allOf', ())) > 1:
        raise ValueError(
            f"Grammar.from_json_schema: {path} uses 'allOf' of several schemas, which "
            'outlines-core does not merge; write the merged schema'
        )
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            unsupported(sub, f'{path}[{key!r}][{name!r}]')
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or ()):
            unsupported(sub, f'{path}[{key!r}][{i}]')
    for key in _SUBSCHEMAS:
        unsupported(schema.get(key), f'{path}[{key!r}]')
