"""Which quickstart-config fields differ from the stages a workdir recorded, named as set.

Every stage's config is recorded in <stage>/quickstart_stage.json (pipeline.check_workdir). A
rerun with other settings is refused naming every field the user changed, spelled as the
quickstart config spells it (`target.train.steps`, `seed`), never a field that merely follows
from one: configs/quickstart.py computes some fields from others (ml_collections references, e.g.
`target.train.checkpoint_every = target steps - draft steps`) and shares others between stages
(`cotrain.train.steps` is `target.train.steps`; every stage's seed is the top-level `seed`).
A shared field is named once, by its shortest spelling; computed fields are only counted, unless
nothing else differs. A field newer than the workdir counts as unchanged while at its default
(specjax.workdir.DEFAULT_VALUED_FIELDS).
"""

from __future__ import annotations

import ml_collections
from ml_collections.config_dict import FieldReference

from specjax.config_diff import ABSENT, differences
from specjax.workdir import at_default

# stages whose config is their section plus spec_eval's data, eval, mesh and seed
EVAL_SHARING_STAGES = ('serve', 'route', 'tasks')


def source_path(config, stage, path: str) -> str:
    """The quickstart-config field a stage-config field comes from (see pipeline.stage_config)."""
    head, _, rest = path.partition('.')
    if head == 'data' and rest and rest != 'seq_len' and rest.split('.')[0] in config.data:
        return path  # the shared data fields
    if stage.name in EVAL_SHARING_STAGES:
        if head in ('data', 'eval', 'mesh') or path == 'seed':
            return f'spec_eval.{path}'
        return f'{stage.name}.{path}'
    return f'{stage.section}.{path}'


def _stored(config, dotted: str):
    """The object stored at a dotted field (a FieldReference or a value); None if absent."""
    node = config
    *parents, name = dotted.split('.')
    for part in parents:
        node = node._fields.get(part) if isinstance(node, ml_collections.ConfigDict) else None
        if isinstance(node, FieldReference):
            node = node.get()
        if not isinstance(node, ml_collections.ConfigDict):
            return None
    return node._fields.get(name)


def _reference_paths(config, prefix: str = '') -> dict[int, list[str]]:
    """id(FieldReference) -> every dotted field holding it, in the config's own order."""
    out: dict[int, list[str]] = {}
    for name, value in config._fields.items():
        path = f'{prefix}{name}'
        if isinstance(value, FieldReference):
            out.setdefault(id(value), []).append(path)
            value = value.get()
        if isinstance(value, ml_collections.ConfigDict):
            for key, paths in _reference_paths(value, path + '.').items():
                out.setdefault(key, []).extend(paths)
    return out


def _computed(obj) -> bool:
    return isinstance(obj, FieldReference) and bool(getattr(obj, '_ops', None))


def changed_fields(config, recorded) -> tuple[list[dict], list[dict]]:
    """(set, computed): the differing fields of `recorded` [(stage, saved JSON, current JSON)],
    one dict per field: {'name', 'saved', 'current', 'stages'}; `computed` are the ones the
    config computes from other fields."""
    refs = _reference_paths(config)
    groups: dict[object, dict] = {}
    for stage, saved, current in recorded:
        for path, old, new in differences(saved, current):
            if (old is ABSENT or new is ABSENT) and at_default(path, new if old is ABSENT else old):
                continue  # a field newer than the workdir, at its default
            field = source_path(config, stage, path)
            obj = _stored(config, field)
            key = id(obj) if isinstance(obj, FieldReference) else field
            names = refs.get(id(obj), [field]) if isinstance(obj, FieldReference) else [field]
            group = groups.setdefault(
                key,
                {
                    'name': min(names, key=lambda p: p.count('.')),
                    'saved': old,
                    'current': new,
                    'stages': [],
                    'computed': _computed(obj),
                },
            )
            if stage.name not in group['stages']:
                group['stages'].append(stage.name)
    fields = list(groups.values())
    return [f for f in fields if not f['computed']], [f for f in fields if f['computed']]


def refusal(config, workdir: str, recorded) -> str | None:
    """The refusal naming every changed field, or None when `recorded` matches."""
    named, computed = changed_fields(config, recorded)
    if not named and not computed:
        return None
    shown = named or computed
    parts = []
    for f in shown:
        where = f' [stages {", ".join(f["stages"])}]' if len(f['stages']) > 1 else ''
        parts.append(f'{f["name"]}: {f["saved"]!r} in the workdir, {f["current"]!r} now{where}')
    text = '; '.join(parts)
    if named and computed:
        n, them = len(computed), 'them' if len(named) > 1 else 'it'
        text += f'; and {n} field{"s" if n > 1 else ""} computed from {them}'
    order = [stage.name for stage, _, _ in recorded]
    first = min((s for f in shown for s in f['stages']), key=order.index)
    return (
        f'{workdir} holds stage {first!r} of a different config ({text}): use a new '
        '--workdir, or rerun with the config that made it'
    )
