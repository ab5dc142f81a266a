"""Sweep specification: config.sweep -> validated prerequisites and points (no running here).

A sweep config (configs/ablations/*.py) has `config.mode = 'sweep'` and a `config.sweep` section:

  base        'path/to/config.py:preset-arg' run at every point (arg optional, as for --config)
  prereqs     tuple of dicts {'name', 'config', 'overrides'}: runs done once, first, in
              <workdir>/prereq/<name>; in order, so a later one may refer to an earlier one
  overrides   ((dotted_field, value), ...) applied to every point
  grid        ((dotted_field, (value, ...)), ...): the points are the product of the values; an
              axis may instead be named, its values setting several fields each:
              (axis_name, ((value, {dotted_field: v, ...}), ...)) (e.g. k -> eval.ks = (k,))
  variants    ((name, {dotted_field: value, ...}), ...): extra points outside the product; a
              third element 'path.py[:arg]' runs that variant with its own config instead of
              base (every override, common ones included, is checked against it)
  seeds       n seeds per configuration, first_seed .. first_seed + n - 1 (a tuple of seeds also
              works when the config is built in Python); each sets `config.seed`

String values may contain `${prereq.NAME}` (absolute workdir of prerequisite NAME) and
`${workdir}` (the sweep workdir). Every field is checked against the base config (or the
prerequisite's config) and its value assigned with ConfigDict's type checks before anything runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from specjax.config_files import load_config
from specjax.sweeps import lifetime

_NAME_RE = re.compile(r'^[A-Za-z0-9_.+-]+$')
_REF_RE = re.compile(r'\$\{([^}]*)\}')

Pairs = tuple[tuple[str, Any], ...]

STATUS_FILE = 'sweep_status.json'  # per run: status, command, timing, results sha256
LOG_FILE = 'sweep.log'  # per run: command line and the process's output
RESULTS_FILE = 'results.json'  # per point: written by the mode, read by the summary


@dataclasses.dataclass(frozen=True)
class ConfigRef:
    """A config file plus its optional get_config argument, as written after --config=."""

    path: str
    arg: str | None = None

    @classmethod
    def parse(cls, text: str, what: str) -> ConfigRef:
        if not isinstance(text, str) or not text:
            raise ValueError(f'{what} must be "path.py[:arg]", got {text!r}')
        path, sep, arg = text.partition(':')
        if not path.endswith('.py'):
            raise ValueError(f'{what} must name a .py config file, got {text!r}')
        return cls(path, arg if sep else None)

    @property
    def flag(self) -> str:
        return self.path if self.arg is None else f'{self.path}:{self.arg}'

    def load(self) -> ml_collections.ConfigDict:
        """get_config([arg]) of the file, loaded by path like ml_collections' config_flags."""
        return load_config(self.flag)


@dataclasses.dataclass(frozen=True)
class Run:
    """One process to run: a prerequisite or a (configuration, seed) point."""

    name: str  # directory name under prereq/ or points/
    kind: str  # 'prereq' | 'point'
    config: ConfigRef
    overrides: Pairs  # as written in the sweep config (with ${...} templates), in order
    resolved: Pairs  # templates substituted; what goes on the command line
    label: str = ''  # configuration shared by seeds (points only)
    seed: int | None = None
    fields: Pairs = ()  # grid / variant values that define the label (table columns)

    def identity(self) -> dict:
        """What must match for a finished run in the workdir to count as this run.

        The config file's name and argument and the overrides as written (templates unresolved,
        so a moved workdir still matches); edits inside the config file are not detected.
        """
        return {
            'config_file': os.path.basename(self.config.path),
            'config_arg': self.config.arg,
            'overrides': [[k, _jsonable(v)] for k, v in self.overrides],
        }


# Config files renamed, by their old name: a sweep workdir from before the rename still matches.
_CONFIG_ALIASES = {'target.py': 'pretrain.py', 'smollm2.py': 'spec_eval_smollm2.py'}


def same_identity(recorded: dict | None, current: dict) -> bool:
    """Whether a recorded Run.identity() is `current`, old config-file names counting as new."""
    if not isinstance(recorded, dict):
        return False
    name = recorded.get('config_file')
    return dict(recorded, config_file=_CONFIG_ALIASES.get(name, name)) == current


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    workdir: str
    base: ConfigRef
    prereqs: tuple[Run, ...]
    points: tuple[Run, ...]
    grid_fields: tuple[str, ...]
    labels: tuple[str, ...]  # configurations in table order (grid product, then variants)
    variants: tuple[str, ...]  # the labels that are variants (outside the grid product)


def _jsonable(value):
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def as_pairs(value, what: str) -> Pairs:
    """Dict or sequence of (dotted_field, value) pairs -> tuple of pairs."""
    if value is None:
        return ()
    if isinstance(value, Mapping | ml_collections.ConfigDict):
        items = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = list(value)
    else:
        raise ValueError(f'{what} must be a dict or a tuple of (field, value) pairs, got {value!r}')
    pairs = []
    for item in items:
        if not (isinstance(item, Sequence) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f'{what}: expected a (dotted_field, value) pair, got {item!r}')
        pairs.append((item[0], item[1]))
    fields = [k for k, _ in pairs]
    dupes = sorted({k for k in fields if fields.count(k) > 1})
    if dupes:
        raise ValueError(f'{what}: field(s) {dupes} given more than once')
    return tuple(pairs)


def _check_name(name, what: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f'{what} must match {_NAME_RE.pattern}, got {name!r}')
    return name


def _value_text(value) -> str:
    text = str(value)
    return re.sub(r'[^A-Za-z0-9_.+-]', '-', text)


def _short_names(fields: Sequence[str]) -> dict[str, str]:
    """Last dotted component, or the full name where two fields share it."""
    last = [f.rsplit('.', 1)[-1] for f in fields]
    return {f: (s if last.count(s) == 1 else f) for f, s in zip(fields, last)}


def seeds_of(value, first: int = 0) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f'config.sweep.seeds must be >= 1, got {value!r}')
        return tuple(range(first, first + value))
    if (
        isinstance(value, Sequence)
        and value
        and all(isinstance(s, int) and not isinstance(s, bool) for s in value)
    ):
        if len(set(value)) != len(value):
            raise ValueError(f'config.sweep.seeds has duplicates: {value!r}')
        return tuple(value)
    raise ValueError(f'config.sweep.seeds must be an int >= 1 or a tuple of ints, got {value!r}')


def check_field(config: ml_collections.ConfigDict, field: str, value, where: str) -> None:
    """ValueError unless `field` exists in `config` and accepts `value` (ConfigDict type rules)."""
    node = config
    parts = field.split('.')
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            prefix = '.'.join(parts[:i]) or '<top level>'
            known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            raise ValueError(
                f'{where}: field {field!r} does not exist in the config ({part!r} not in '
                f'{prefix}; known there: {known})'
            )
        if i < len(parts) - 1:
            node = node[part]
    current = node[parts[-1]]
    if isinstance(current, ml_collections.ConfigDict):
        raise ValueError(f'{where}: field {field!r} is a section, not a value')
    field_type = node.get_type(parts[-1])
    if field_type is type(None):
        raise ValueError(
            f'{where}: field {field!r} is an untyped None in the config, so it cannot be set '
            'from the command line; give it a typed default (or a typed FieldReference)'
        )
    probe = ml_collections.ConfigDict({'x': ml_collections.FieldReference(current, field_type)})
    try:
        probe.x = tuple(value) if field_type is tuple and isinstance(value, list) else value
    except TypeError as e:
        raise ValueError(f'{where}: value {value!r} does not fit field {field!r}: {e}') from None


def _no_seed(pairs: Pairs, what: str) -> None:
    if any(k == 'seed' for k, _ in pairs):
        raise ValueError(f'{what} sets field seed: seeds come from config.sweep.seeds')


def _resolve(value, refs: Mapping[str, str], what: str):
    if not isinstance(value, str):
        return value

    def sub(match):
        key = match.group(1)
        if key not in refs:
            raise ValueError(f'{what}: unknown reference ${{{key}}}; known: {sorted(refs)}')
        return refs[key]

    return _REF_RE.sub(sub, value)


def _resolve_pairs(pairs: Pairs, refs, what: str) -> Pairs:
    return tuple((k, _resolve(v, refs, f'{what} {k}')) for k, v in pairs)


def _plan_prereqs(items, workdir: str, refs: dict[str, str]) -> list[Run]:
    """The prerequisite Runs of config.sweep.prereqs, in order, each checked against its config.

    Adds `prereq.NAME` (the prerequisite's workdir) to `refs` after each one, so a later
    prerequisite may refer to an earlier one. ValueError naming the entry when it is malformed,
    its name is taken, or an override does not fit its config.
    """
    prereqs = []
    for i, item in enumerate(items):
        what = f'config.sweep.prereqs[{i}]'
        if not isinstance(item, Mapping) or set(item) - {'name', 'config', 'overrides'}:
            raise ValueError(f'{what} must be a dict with name, config, overrides; got {item!r}')
        name = _check_name(item.get('name'), f'{what}.name')
        if f'prereq.{name}' in refs:
            raise ValueError(f'{what}.name {name!r} is used twice')
        ref = ConfigRef.parse(item.get('config'), f'{what}.config')
        overrides = as_pairs(item.get('overrides'), f'{what}.overrides')
        resolved = _resolve_pairs(overrides, refs, what)
        loaded = ref.load()
        for k, v in resolved:
            check_field(loaded, k, v, f'{what} ({ref.flag})')
        prereqs.append(Run(name, 'prereq', ref, overrides, resolved))
        refs[f'prereq.{name}'] = os.path.join(workdir, 'prereq', name)
    return prereqs


def _plan_points(configurations, common: Pairs, seeds, refs, loaded: dict) -> list[Run]:
    """The point Runs: every configuration with each seed, in order, overrides being `common`
    updated by the configuration's own and then the seed, each checked against its config.

    `loaded` maps config flags to loaded configs; configs not in it are loaded (and added) on
    first use. ValueError naming the point when an override does not fit.
    """
    points = []
    for label, fields, own, ref in configurations:
        if ref.flag not in loaded:
            loaded[ref.flag] = ref.load()
        check_field(loaded[ref.flag], 'seed', seeds[0], f'point {label} ({ref.flag})')
        merged = dict(common)
        merged.update(own)
        for seed in seeds:
            overrides = tuple(merged.items()) + (('seed', seed),)
            resolved = _resolve_pairs(overrides, refs, f'point {label}')
            for k, v in resolved:
                check_field(loaded[ref.flag], k, v, f'point {label} ({ref.flag})')
            name = f'{label}__seed-{seed}'
            points.append(Run(name, 'point', ref, overrides, resolved, label, seed, fields))
    return points


def plan_sweep(sweep: ml_collections.ConfigDict, workdir: str) -> SweepPlan:
    """Validates config.sweep against the base config and lists every run, before running any."""
    workdir = os.path.abspath(workdir)
    base = ConfigRef.parse(sweep.get('base'), 'config.sweep.base')
    base_config = base.load()
    refs = {'workdir': workdir}
    prereqs = _plan_prereqs(sweep.get('prereqs') or (), workdir, refs)

    common = as_pairs(sweep.get('overrides'), 'config.sweep.overrides')
    axes = [_axis(field, values) for field, values in as_pairs(sweep.get('grid'), 'grid')]
    grid_fields = tuple(f for f, _ in axes)
    _no_seed(common, 'config.sweep.overrides')
    for _, values in axes:
        for _, sets in values:
            _no_seed(sets, 'config.sweep.grid')
    configurations = []  # (label, fields, overrides, config)
    if axes:
        short = _short_names(grid_fields)
        for combo in itertools.product(*[values for _, values in axes]):
            fields = tuple((f, v) for f, (v, _) in zip(grid_fields, combo))
            label = '__'.join(f'{short[f]}-{_value_text(v)}' for f, v in fields)
            overrides = tuple(pair for _, sets in combo for pair in sets)
            configurations.append((label, fields, overrides, base))
    variant_labels = []
    for i, item in enumerate(sweep.get('variants') or ()):
        what = f'config.sweep.variants[{i}]'
        if not (isinstance(item, Sequence) and len(item) in (2, 3)):
            raise ValueError(f'{what} must be (name, {{field: value}}[, config]), got {item!r}')
        name = _check_name(item[0], f'{what} name')
        overrides = as_pairs(item[1], what)
        _no_seed(overrides, what)
        ref = ConfigRef.parse(item[2], f'{what} config') if len(item) == 3 else base
        fields = tuple((f, v) for f, v in overrides if f in grid_fields)
        configurations.append((name, fields, overrides, ref))
        variant_labels.append(name)
    if not configurations:
        configurations.append(('base', (), (), base))
    labels = [c[0] for c in configurations]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f'config.sweep: point name(s) {dupes} occur twice (grid vs variants?)')

    seeds = seeds_of(sweep.get('seeds', 1), sweep.get('first_seed', 0))
    points = _plan_points(configurations, common, seeds, refs, {base.flag: base_config})
    return SweepPlan(
        workdir,
        base,
        tuple(prereqs),
        tuple(points),
        grid_fields,
        tuple(labels),
        tuple(variant_labels),
    )


def _axis(field: str, values) -> tuple[str, tuple]:
    """A grid axis -> (name, ((value, ((dotted_field, v), ...)), ...)).

    Plain: (dotted_field, (v, ...)), each value setting that field. Named: (axis_name,
    ((value, {dotted_field: v, ...}), ...)), each value setting the fields of its mapping.
    """
    what = f'config.sweep.grid {field!r}'
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise ValueError(f'{what} needs a non-empty tuple of values')
    named = [
        isinstance(v, Sequence)
        and not isinstance(v, str)
        and len(v) == 2
        and isinstance(v[1], Mapping | ml_collections.ConfigDict)
        for v in values
    ]
    if any(named) and not all(named):
        raise ValueError(f'{what}: mix of plain values and (value, {{field: v}}) pairs')
    if not all(named):
        return field, tuple((v, ((field, v),)) for v in values)
    _check_name(field, f'{what} (a named axis)')
    return field, tuple((v, as_pairs(sets, f'{what} value {v!r}')) for v, sets in values)


def format_override(field: str, value) -> str:
    """--config.<field>=<value> in the form ml_collections' config_flags parses back exactly."""
    if isinstance(value, bool):
        text = 'true' if value else 'false'
    elif isinstance(value, tuple | list):
        text = repr(tuple(value))
    elif isinstance(value, str):
        text = value
    else:
        text = repr(value)
    return f'--config.{field}={text}'


# Workdir layout, shared by the runner and the summary.
def point_dir(plan: SweepPlan, run: Run) -> str:
    sub = 'prereq' if run.kind == 'prereq' else 'points'
    return os.path.join(plan.workdir, sub, run.name)


def read_status(workdir: str) -> dict | None:
    """sweep_status.json (None if absent); 'running' reads 'interrupted' once its runner ended."""
    try:
        with open(os.path.join(workdir, STATUS_FILE)) as f:
            return lifetime.without_dead_runner(json.load(f))
    except (OSError, json.JSONDecodeError):
        return None


def sha256_file(path: str) -> str:
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()
