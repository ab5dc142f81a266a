"""Model size presets: the one registry that configs, benchmarks and experiments read.

Shapes only (vocab_size and max_len come from the data config). TARGETS are pretrained targets
(configs/pretrain.py, configs/cotrain.py, configs/quickstart.py); DRAFTS are drafts and distilled
students (configs/distill.py, configs/cotrain.py's draft). Each is a dict of TransformerConfig
fields: d_model, n_layers, n_heads, n_kv_heads, d_ff. PAIRS are the benchmarks' random-init
target/draft pairs (benchmarks/cli.py --preset), complete with vocab_size and max_len since no
data config stands behind them.
"""

from __future__ import annotations


def _shape(d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int) -> dict:
    return dict(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff
    )


TARGETS = {
    'tiny': _shape(64, 2, 4, 2, 256),  # 0.39M params with the 4096 vocabulary
    'quickstart': _shape(192, 2, 4, 2, 512),  # 1.6M: the quickstart's CPU target
    'small': _shape(256, 3, 4, 2, 768),  # 3.4M: wide and shallow, fastest per token on CPU
    'base': _shape(1024, 24, 16, 8, 2816),  # 287M: an accelerator run
    'smollm2': _shape(576, 30, 9, 3, 1536),  # SmolLM2-135M's shape (benchmarks without weights)
}

DRAFTS = {
    'test': _shape(32, 1, 2, 2, 64),  # unit tests and smoke runs
    'tiny': _shape(64, 2, 2, 2, 256),  # ~0.4M params with the 4096 vocabulary
    'small': _shape(128, 2, 4, 4, 512),  # ~0.9M
    'medium': _shape(256, 4, 4, 4, 1024),  # for accelerator targets
}


# name: target and draft TransformerConfig fields (shape, vocab_size, max_len) of a random-init
# benchmark pair (benchmarks.sampling, .engine, .xla_flags, .round_profile without a workdir).
PAIRS = {
    'default': dict(
        target=dict(_shape(512, 6, 8, 8, 1408), vocab_size=4096, max_len=256),  # ~21M params
        draft=dict(_shape(256, 2, 4, 4, 704), vocab_size=4096, max_len=256),  # ~2.7M
    ),
    'tiny': dict(  # seconds-long smoke runs
        target=dict(_shape(64, 2, 4, 4, 128), vocab_size=512, max_len=128),
        draft=dict(_shape(32, 1, 2, 2, 64), vocab_size=512, max_len=128),
    ),
}


def pair(name: str) -> tuple[dict, dict]:
    """(target, draft) TransformerConfig fields of PAIRS[name]; ValueError naming the known."""
    if name not in PAIRS:
        raise ValueError(f'pair preset {name!r} unknown; known: {sorted(PAIRS)}')
    return dict(PAIRS[name]['target']), dict(PAIRS[name]['draft'])


def shape(kind: str, name: str) -> dict:
    """The preset `name` of TARGETS ('target') or DRAFTS ('draft'); ValueError naming the known."""
    table = {'target': TARGETS, 'draft': DRAFTS}[kind]
    if name not in table:
        raise ValueError(f'{kind} size preset {name!r} unknown; known: {sorted(table)}')
    return dict(table[name])
