"""The benchmarks' one command-line style: argparse, the common flags, models from the presets.

Every benchmark builds its parser with `parser(__doc__, out=..., ...)`, which adds the flags it
asks for, each with the benchmark's default:

  --out                JSON results path ('' where writing is optional)
  --preset             a random-init target/draft pair: specjax.models.presets.PAIRS
  --target / --draft   size presets: specjax.models.presets.TARGETS / DRAFTS
  --seed, --repeats    seed; timed repetitions
  --compilation_cache  persistent JAX compilation cache ('' = off): `setup_cache(args)`

Benchmarks of a trained quickstart pair take `add_workdir_pair(p)` instead: --workdir and
--draft, the draft's sub-workdir (e.g. draft_distilled). Comma-separated lists parse with
`ints` / `floats`, and `add_bool` gives absl's --flag / --noflag. `build_models(preset)` and
`preset_config(kind, name, ...)` build models from the registry; `load_pair` loads a trained one.
"""

from __future__ import annotations

import argparse
import json
import os

from specjax import jsonio
from specjax.models import presets

COMPILATION_CACHE = '~/.cache/specjax/jax-cache'
_UNSET = object()


def ints(text: str) -> tuple[int, ...]:
    """'1,8' -> (1, 8)."""
    return tuple(int(x) for x in text.split(','))


def floats(text: str) -> tuple[float, ...]:
    """'0.7,1.0' -> (0.7, 1.0)."""
    return tuple(float(x) for x in text.split(','))


def _bool(text: str) -> bool:
    if text.lower() in ('true', '1', 'yes'):
        return True
    if text.lower() in ('false', '0', 'no'):
        return False
    raise argparse.ArgumentTypeError(f'expected true or false, got {text!r}')


def add_bool(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    """--name, --name=true|false and --noname (absl's boolean flag spellings)."""
    p.add_argument(f'--{name}', nargs='?', const=True, default=default, type=_bool, help=help)
    p.add_argument(f'--no{name}', dest=name, action='store_false', help=argparse.SUPPRESS)


def parser(
    doc: str,
    *,
    out: str | None | object = _UNSET,
    preset: str | None = None,
    target: str | None = None,
    draft: str | None = None,
    seed: int | None = None,
    repeats: int | None = None,
    compilation_cache: bool = False,
) -> argparse.ArgumentParser:
    """An argparse parser for a benchmark whose module docstring is `doc`, with the common flags
    given a default here (the rest are left out): the first docstring line is the description,
    the rest the epilog of --help."""
    head, _, body = doc.strip().partition('\n')
    p = argparse.ArgumentParser(
        description=head,
        epilog=body.strip('\n') or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if out is not _UNSET:
        p.add_argument('--out', default=out, help='JSON results path')
    if preset is not None:
        p.add_argument(
            '--preset',
            default=preset,
            choices=sorted(presets.PAIRS),
            help='random-init target/draft pair (specjax.models.presets.PAIRS)',
        )
    if target is not None:
        p.add_argument(
            '--target',
            default=target,
            choices=sorted(presets.TARGETS),
            help='target size preset (specjax.models.presets.TARGETS)',
        )
    if draft is not None:
        p.add_argument(
            '--draft',
            default=draft,
            choices=sorted(presets.DRAFTS),
            help='draft size preset (specjax.models.presets.DRAFTS)',
        )
    if seed is not None:
        p.add_argument('--seed', default=seed, type=int, help='random seed')
    if repeats is not None:
        p.add_argument('--repeats', default=repeats, type=int, help='timed repetitions')
    if compilation_cache:
        p.add_argument(
            '--compilation_cache',
            default=COMPILATION_CACHE,
            help='persistent JAX compilation cache dir ("" = off); reruns compile faster',
        )
    return p


def add_workdir_pair(p: argparse.ArgumentParser, workdir: str = 'workdirs/quickstart') -> None:
    """--workdir (a finished quickstart workdir) and --draft (its draft's sub-workdir)."""
    p.add_argument('--workdir', default=workdir, help='quickstart workdir with target/')
    p.add_argument('--draft', default='draft_distilled', help="the draft's sub-workdir")


def setup_cache(args) -> None:
    """Turns on the persistent compilation cache of --compilation_cache (unless '')."""
    if getattr(args, 'compilation_cache', ''):
        import jax

        jax.config.update('jax_compilation_cache_dir', os.path.expanduser(args.compilation_cache))
        jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


# ----------------------------------------------------------------------------- models


def preset_config(kind: str, name: str, vocab_size: int, max_len: int, **fields):
    """TransformerConfig of TARGETS[name] ('target') or DRAFTS[name] ('draft')."""
    from specjax.models import TransformerConfig

    return TransformerConfig(
        vocab_size=vocab_size, max_len=max_len, **presets.shape(kind, name), **fields
    )


def truncated_draft(target, n_layers: int = 1):
    """The target's first n_layers blocks with its embedding and final norm (early exit)."""
    import dataclasses

    from flax import nnx

    from specjax.models import Transformer

    cfg = dataclasses.replace(target.config, n_layers=n_layers)
    draft = Transformer(cfg, rngs=nnx.Rngs(0))
    draft.embed.set_value(target.embed.get_value())
    nnx.update(draft.final_norm, nnx.state(target.final_norm))
    for i in range(n_layers):
        nnx.update(draft.blocks[i], nnx.state(target.blocks[i]))
    return draft


def build_models(preset: str, seed: int = 0):
    """The random-init pair PAIRS[preset]: target and the drafts {'independent' (the preset's
    draft, its own init), 'truncated' (the target's first layer), 'self' (the target)}."""
    from flax import nnx

    from specjax.models import Transformer, TransformerConfig

    t_fields, d_fields = presets.pair(preset)
    target = Transformer(TransformerConfig(**t_fields), rngs=nnx.Rngs(seed))
    drafts = {
        'independent': Transformer(TransformerConfig(**d_fields), rngs=nnx.Rngs(seed + 1)),
        'truncated': truncated_draft(target, 1),
        'self': target,
    }
    return target, drafts


def load_pair(workdir: str, draft: str):
    """The trained target (<workdir>/target) and draft (<workdir>/<draft>); same tokenizer."""
    from specjax.checkpoint import load_model

    target, t_meta = load_model(os.path.join(workdir, 'target'))
    draft_model, d_meta = load_model(os.path.join(workdir, draft))
    if t_meta.get('tokenizer') != d_meta.get('tokenizer'):
        raise ValueError(f'{workdir}: target and {draft} tokenizers differ')
    return target, draft_model


def emit(result: dict, table: str, out: str | None) -> dict:
    """Prints `table`, then `result` as one sorted JSON line, also written to `out` if given."""
    print(table)
    line = json.dumps(result, sort_keys=True)
    print(line)
    if out:
        jsonio.write_text(out, line + '\n')
    return result
