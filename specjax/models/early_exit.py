"""Early-exit drafts: a target's first layers with its own embedding, final norm and head.

The cheapest draft a real checkpoint offers without training: it shares the target's tokenizer
and vocabulary by construction, and both specjax and transformers can run it (export it with
`export_llama`), which is what the peer benchmark needs.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from specjax.models import Transformer
from specjax.models.layout import to_layout


def early_exit_draft(model: Transformer, n_layers: int) -> Transformer:
    """A Transformer of `model`'s first `n_layers` blocks (parameters copied, not shared), in
    `model`'s layout (stacked or not)."""
    cfg = model.config
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers:
        raise ValueError(f'early-exit n_layers must be a positive int, got {n_layers!r}')
    if n_layers > cfg.n_layers:
        raise ValueError(
            f"early-exit n_layers={n_layers} is above the model's n_layers={cfg.n_layers}"
        )
    draft_cfg = dataclasses.replace(cfg, n_layers=n_layers, scan_layers=False)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(draft_cfg, rngs=nnx.Rngs(0))))
    source = dict(nnx.to_flat_state(nnx.state(to_layout(model, scan_layers=False))))
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        var.set_value(source[path].get_value().copy())
    return to_layout(nnx.merge(graphdef, nnx.from_flat_state(flat)), cfg.scan_layers)
