"""Config files: load `path/to/config.py[:arg]` as `--config=` does, and parse get_config's arg.

A config file defines `get_config(arg=None) -> ml_collections.ConfigDict`. `load_config` calls it
the way ml_collections' config_flags does for `--config=configs/x.py:size=tiny` (everything after
the first ':' is the argument; no ':' calls get_config()), then applies `(dotted_field, value)`
overrides with `--config.a.b=v` semantics. Inside a config, `parse_arg` turns its argument
('size=tiny,preset=smollm2', or a bare 'tiny' for the first option) into typed fields:

  def get_config(arg=None):
    opts = parse_arg(arg, size=one_of('small', _PRESETS), draft='', steps=100)
    ...  # opts.size in _PRESETS, opts.draft a str, opts.steps an int

Ground floor: imports nothing from specjax (configs, sweeps, tests and benchmarks all use it).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections
from absl import flags
from ml_collections.config_flags import config_path, tuple_parser

__all__ = ['join_spec', 'load_config', 'one_of', 'parse_arg', 'split_spec']


# ----------------------------------------------------------------------------- parse_arg


class one_of:
    """A string option of parse_arg restricted to `choices` (a sequence, or a mapping's keys)."""

    __slots__ = ('choices', 'default')

    def __init__(self, default: str, choices: Iterable[str]):
        self.default, self.choices = default, tuple(choices)
        if default not in self.choices:
            raise ValueError(f'one_of: default {default!r} is not among {self.choices}')

    def __repr__(self) -> str:
        return f'one_of({self.default!r}, {self.choices!r})'


_TRUE = ('true', '1', 'yes', 'on')
_FALSE = ('false', '0', 'no', 'off')


def _spelling(name: str, default) -> str:
    if isinstance(default, one_of):
        return f'{name}={"|".join(default.choices)}'
    return f'{name}=<{type(default).__name__}, default {default!r}>'


def _convert(name: str, text: str, default, arg: str, expected: str):
    """The option's string value -> the default's type; ValueError naming the argument."""

    def bad(why: str):
        return ValueError(f'config argument {arg!r}: {name}={text!r} {why}; expected {expected}')

    if isinstance(default, one_of):
        if text not in default.choices:
            raise bad(f'is not one of {"|".join(default.choices)}')
        return text
    if isinstance(default, bool):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise bad('is not a bool (true|false)')
    if isinstance(default, int | float):
        try:
            return type(default)(text)
        except ValueError:
            raise bad(f'is not {"an int" if isinstance(default, int) else "a float"}') from None
    return text


def parse_arg(arg: str | None, /, **defaults) -> ml_collections.ConfigDict:
    """A config file's get_config argument -> ConfigDict of typed options (big_vision style).

    `defaults` names every option and its default, whose type is the option's type: str, int,
    float, bool ('true'/'false', '1'/'0', 'yes'/'no'), or `one_of(default, choices)` for a
    string restricted to choices. `arg` is comma-separated `key=value` items; None or '' gives
    the defaults. An item without '=' is the value of the first option (`'tiny'` is
    `'size=tiny'` when size comes first), or sets a bool option of that name to True. Empty items
    are skipped and a key given twice keeps its last value. An unknown key or a value that does
    not fit raises ValueError naming the argument and the accepted spelling.
    """
    if not defaults:
        raise TypeError('parse_arg needs at least one option (name=default)')
    first = next(iter(defaults))
    expected = 'comma-separated ' + ', '.join(_spelling(k, v) for k, v in defaults.items())
    values = {k: (v.default if isinstance(v, one_of) else v) for k, v in defaults.items()}
    if arg is not None and not isinstance(arg, str):
        raise ValueError(f'config argument {arg!r}: expected a string, {expected}')
    for item in (arg or '').split(','):
        item = item.strip()
        if not item:
            continue
        key, sep, text = item.partition('=')
        if not sep:
            flag = isinstance(defaults.get(item), bool)
            key, text = (item, 'true') if flag else (first, item)
        if key not in defaults:
            raise ValueError(
                f'config argument {arg!r}: unknown option {key!r}; expected {expected}'
            )
        values[key] = _convert(key, text, defaults[key], arg, expected)
    return ml_collections.ConfigDict(values)


# ----------------------------------------------------------------------------- load_config


def share_seed(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`c` with every section's `seed` a reference to the top-level `seed` (added, default 0):
    one --config.seed=N sets them all (the quickstart configs)."""
    if 'seed' not in c:
        c.seed = 0
    for name in list(c.keys()):
        section = c[name]
        if isinstance(section, ml_collections.ConfigDict) and 'seed' in section:
            section.seed = c.get_ref('seed')
    return c


def split_spec(spec: str) -> tuple[str, str | None]:
    """'path.py:arg' -> ('path.py', 'arg'); 'path.py' -> ('path.py', None) (the first ':')."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f'config spec must be "path.py[:arg]", got {spec!r}')
    path, sep, arg = spec.partition(':')
    return path, (arg if sep else None)


def join_spec(path, arg: str | None = None) -> str:
    """(path, arg) -> 'path:arg', or 'path' when arg is None (get_config() without argument)."""
    return str(path) if arg is None else f'{path}:{arg}'


def _load_module(path: str):
    name = 'specjax_config_' + re.sub(r'\W', '_', os.path.abspath(path))
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# The parsers config_flags uses for `--config.<field>=<text>`, by the field's type.
_PARSERS = {
    float: flags.FloatParser(),
    bool: flags.BooleanParser(),
    int: flags.IntegerParser(),
    tuple: tuple_parser.TupleParser(),
}


def _override(config: ml_collections.ConfigDict, field: str, value: Any, spec: str) -> None:
    """config.<field> = value as `--config.<field>=value` would set it."""
    where = f'{spec}: override {field}={value!r}'
    try:
        field_type = config_path.get_type(field, config)
    except (KeyError, IndexError, AttributeError, ValueError) as e:
        holder = field.rpartition('.')[0]
        try:
            node = config_path.get_value(holder, config) if holder else config
            known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        except (KeyError, IndexError, AttributeError, ValueError):
            known = []
        raise ValueError(
            f'{where}: field {field!r} does not exist in the config ({e}; known in '
            f'{holder or "<top level>"}: {known})'
        ) from None
    if isinstance(field_type, type) and issubclass(field_type, ml_collections.ConfigDict):
        raise ValueError(f'{where}: field {field!r} is a section, not a value')
    if isinstance(value, str) and field_type is not str:
        if field_type not in _PARSERS:
            raise ValueError(
                f'{where}: field {field!r} has type {field_type.__name__}, which a string '
                'cannot override (give the value itself)'
            )
        try:
            value = _PARSERS[field_type].parse(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f'{where}: {e}') from None
    elif field_type is tuple and isinstance(value, list):
        value = tuple(value)
    try:
        config_path.set_value(field, config, value)
    except TypeError as e:
        raise ValueError(f'{where}: {e}') from None


def load_config(
    spec: str, overrides: Iterable[tuple[str, Any]] | Mapping[str, Any] = ()
) -> ml_collections.ConfigDict:
    """get_config([arg]) of 'path/to/config.py[:arg]', as `--config=path[:arg]` loads it.

    The path is relative to the working directory (as for config_flags); the file is executed
    afresh on every call. `overrides` are (dotted_field, value) pairs (or a mapping), applied in
    order like `--config.<field>=<value>`: the field must exist; a string value for a bool, int,
    float or tuple field is parsed as the flag would be ('true', '5', '(1,2)'); other values are
    assigned with ConfigDict's type checks (an int fits a float field; a list becomes a tuple);
    a field linked by a FieldReference updates everything that refers to it. The result is not
    locked.
    """
    path, arg = split_spec(spec)
    if not os.path.isfile(path):
        raise ValueError(f'Config file {path!r} does not exist (cwd {os.getcwd()!r})')
    module = _load_module(path)
    config = module.get_config() if arg is None else module.get_config(arg)
    if not isinstance(config, ml_collections.ConfigDict):
        raise ValueError(f'{spec}: get_config() returned {type(config).__name__}')
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    for field, value in items:
        _override(config, field, value, spec)
    return config
