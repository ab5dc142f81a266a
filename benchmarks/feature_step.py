r"""Benchmark (not a test): what one training-time-test step of a feature draft costs on cached
target data (specjax.distill.feature_ttt, `cached=True`), by unroll depth.

  python -m benchmarks.feature_step --target=smollm2 --batch=8 --seq_len=128 --draft_vocab=4096

The target is only a shape here (its width, layer count and vocabulary; no weights): a cached
step never runs it. It reads the batch's features [B, T, 3, E] and target_logp [B, T, N] in
bfloat16, as specjax.distill.feature_cache stores them, and updates a randomly initialised
one-layer draft (specjax.models.feature_draft) with AdamW, state donated as in training.

Times (median of --repeats after a warm-up, compile timed apart), per ttt_steps J = 1..--ttt_steps:
  step_s      the jitted cached step
  per_token   step_s / (B T)
  vs J = 1    step_s / step_s(J = 1): what each unrolled step adds
Prints a table and one JSON line (also written to --out if given).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import cli
from specjax.distill.feature_ttt import TTTSettings, jit_feature_step
from specjax.models.feature_draft import FeatureDraft, FeatureDraftConfig, default_feature_layers
from specjax.parallel import batch_sharding, default_mesh_config, make_mesh
from specjax.sampling.calibrate import median_time
from specjax.train.config import default_train_config
from specjax.train.optimizer import learning_rate_schedule, make_optimizer
from specjax.train.state import TrainState, state_shardings

SMOLLM2_VOCAB = 49152


def parser():
    p = cli.parser(__doc__, out=None, target='smollm2', repeats=5)
    p.add_argument('--batch', default=8, type=int, help='batch size B')
    p.add_argument('--seq_len', default=128, type=int, help='row length T')
    p.add_argument('--draft_vocab', default=4096, type=int, help='N, the draft vocabulary')
    p.add_argument('--ttt_steps', default=3, type=int, help='the largest unroll J measured')
    return p


def _batch(rng, b: int, t: int, n_layers: int, d_model: int, vocab: int, n: int) -> dict:
    """A cached batch: the step's keys plus bfloat16 features and target log-probs."""
    logits = rng.standard_normal((b, t, n)).astype(np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return {
        'tokens': rng.integers(3, vocab, (b, t)).astype(np.int32),
        'positions': np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        'segment_ids': np.ones((b, t), np.int32),
        'loss_mask': np.ones((b, t - 1), bool),
        'features': jnp.asarray(rng.standard_normal((b, t, n_layers, d_model)), jnp.bfloat16),
        'target_logp': jnp.asarray(logp, jnp.bfloat16),
    }


def run(target='smollm2', batch=8, seq_len=128, draft_vocab=4096, ttt_steps=3, repeats=5):
    """Measures the quantities of the module docstring; returns them as a dict."""
    vocab = SMOLLM2_VOCAB if target == 'smollm2' else draft_vocab
    t_cfg = cli.preset_config('target', target, vocab, seq_len)
    layers = default_feature_layers(t_cfg.n_layers)
    d_cfg = FeatureDraftConfig(target=t_cfg, feature_layers=layers, draft_vocab_size=draft_vocab)
    mesh_cfg = default_mesh_config()
    mesh, rules = make_mesh(mesh_cfg), mesh_cfg.rules
    graphdef, params = nnx.split(FeatureDraft(d_cfg, rngs=nnx.Rngs(0)))
    train = default_train_config()
    tx, schedule = make_optimizer(train), learning_rate_schedule(train)
    state_shard = state_shardings(tx, params, mesh, rules)
    b_shard = batch_sharding(mesh, rules)
    host = _batch(
        np.random.default_rng(0), batch, seq_len, len(layers), t_cfg.d_model, vocab, draft_vocab
    )
    data = {k: jax.device_put(v, b_shard) for k, v in host.items()}
    out = {
        'target': target,
        'batch': batch,
        'seq_len': seq_len,
        'draft_vocab': draft_vocab,
        'feature_layers': list(layers),
        'draft_params': int(sum(x.size for x in jax.tree.leaves(params))),
        'steps': [],
    }
    for j in range(1, ttt_steps + 1):
        s = TTTSettings(feature_layers=layers, ttt_steps=j)
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=jax.tree.map(jnp.copy, params),  # the step donates its state
            opt_state=tx.init(params),
            rng=jax.random.key_data(jax.random.key(0)),
        )
        step = jit_feature_step(
            graphdef, None, tx, schedule, s, None, (state_shard, None, b_shard), mesh, cached=True
        )
        holder = {'state': jax.device_put(state, state_shard)}

        def run_step(step=step, holder=holder):
            holder['state'], metrics = step(holder['state'], None, data)
            return metrics['loss']

        t0 = time.perf_counter()
        jax.block_until_ready(run_step())
        compile_s = time.perf_counter() - t0
        step_s = median_time(run_step, repeats)
        out['steps'].append(
            {'ttt_steps': j, 'step_s': step_s, 'compile_s': compile_s,
             'per_token_ms': 1e3 * step_s / (batch * seq_len)}
        )  # fmt: skip
    base = out['steps'][0]['step_s']
    for row in out['steps']:
        row['vs_one_step'] = row['step_s'] / base
    out['backend'] = jax.default_backend()
    return out


def format_table(r: dict) -> str:
    head = (
        f'feature draft ({r["draft_params"]:,} params) of target {r["target"]}, N = '
        f'{r["draft_vocab"]}, B={r["batch"]} T={r["seq_len"]}, cached step, {r["backend"]}'
    )
    lines = [head, '  J   step ms   per token ms   vs J=1   compile s']
    for row in r['steps']:
        lines.append(
            f'  {row["ttt_steps"]}  {row["step_s"] * 1e3:9.1f}  {row["per_token_ms"]:12.3f}'
            f'  {row["vs_one_step"]:7.2f}  {row["compile_s"]:9.1f}'
        )
    return '\n'.join(lines)


def main(argv=None):
    args = parser().parse_args(argv)
    result = run(
        args.target, args.batch, args.seq_len, args.draft_vocab, args.ttt_steps, args.repeats
    )
    return cli.emit(result, format_table(result), args.out)


if __name__ == '__main__':
    main()
