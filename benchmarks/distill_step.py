r"""Benchmark (not a test): what a distillation step costs against its parts, and what on-policy
generation adds.

  python -m benchmarks.distill_step --target=small --draft=tiny --batch=16 --seq_len=128

Times (median of --repeats after a warm-up, compile excluded), randomly initialised models:
  teacher_fwd    the teacher's forward on a [B, T] batch (logits kept on device)
  draft_fwd_bwd  the draft's distillation loss and gradient against fixed teacher logits
  step_dataset   the jitted distill step with the dataset source (teacher forward + draft
                 forward/backward + AdamW update), state donated as in training
  overhead       step_dataset / (teacher_fwd + draft_fwd_bwd)      (target: <= 1.25)
  generate       on-policy data: the draft continues prompt_len-token prompts for max_new_tokens
                 (jitted sampler) and the rows are assembled
  step_generated the distill step on those [B, prompt_len + max_new_tokens] rows
  generation_share  generate / (generate + step_generated)
Prints a table and one JSON line (also written to --out if given).
"""

from __future__ import annotations

import jax
import numpy as np

from benchmarks import cli
from specjax.distill import sources
from specjax.distill.config import default_distill_config
from specjax.distill.steps import LossSettings, draft_loss, forward, jit_distill_step, step_batch
from specjax.parallel import batch_sharding, default_mesh_config, make_mesh, param_shardings
from specjax.sampling import SamplingConfig
from specjax.sampling.calibrate import median_time
from specjax.train.config import default_train_config
from specjax.train.optimizer import learning_rate_schedule, make_optimizer
from specjax.train.state import plan_train_state


def parser():
    p = cli.parser(__doc__, out=None, target='small', draft='tiny', repeats=5)
    p.add_argument('--batch', default=16, type=int, help='batch size B')
    p.add_argument('--seq_len', default=128, type=int, help='dataset row length T')
    p.add_argument('--vocab', default=4096, type=int, help='vocabulary size')
    p.add_argument('--prompt_len', default=32, type=int, help='on-policy prompt tokens')
    p.add_argument('--max_new_tokens', default=64, type=int, help='generated tokens per prompt')
    p.add_argument('--divergence', default='fkl', help='config.distill.divergence')
    return p


def _batch(rng, b, t, vocab):
    tokens = rng.integers(3, vocab, (b, t)).astype(np.int32)
    return {
        'tokens': tokens,
        'segment_ids': np.ones((b, t), np.int32),
        'positions': np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        'domain_ids': np.zeros((b, t), np.int32),
    }


def run(
    target='small',
    draft='tiny',
    batch=16,
    seq_len=128,
    vocab=4096,
    prompt_len=32,
    max_new_tokens=64,
    divergence='fkl',
    repeats=5,
) -> dict:
    """Measures the quantities of the module docstring; returns them as a dict."""
    max_len = max(seq_len, prompt_len + max_new_tokens + 1)
    t_cfg = cli.preset_config('target', target, vocab, max_len)
    d_cfg = cli.preset_config('draft', draft, vocab, max_len)
    mesh_cfg = default_mesh_config()
    mesh, rules = make_mesh(mesh_cfg), mesh_cfg.rules
    train = default_train_config()
    tx, schedule = make_optimizer(train), learning_rate_schedule(train)
    d = default_distill_config()
    d.divergence = divergence
    loss = LossSettings.from_config(d)
    teacher_plan = plan_train_state(t_cfg, tx, 1, mesh, rules)
    teacher_params = teacher_plan.init().params
    plan = plan_train_state(d_cfg, tx, 0, mesh, rules)
    state = plan.init()
    b_shard = batch_sharding(mesh, rules)
    t_shard = param_shardings(mesh, teacher_params, rules)
    host = _batch(np.random.default_rng(0), batch, seq_len, vocab)
    data = {
        k: jax.device_put(v, b_shard)
        for k, v in sources.dataset_batch(host).items()
        if k in ('tokens', 'positions', 'segment_ids', 'loss_mask', 'ce_mask')
    }

    teacher_fwd = jax.jit(lambda tp, b: forward(teacher_plan.graphdef, tp, b))
    t_logits = teacher_fwd(teacher_params, data)
    grad = jax.jit(
        jax.value_and_grad(lambda dp, tl, b: draft_loss(plan.graphdef, dp, tl, b, loss)[0])
    )
    step = jit_distill_step(
        plan.graphdef,
        teacher_plan.graphdef,
        tx,
        schedule,
        loss,
        plan.shardings,
        t_shard,
        b_shard,
        mesh,
    )
    holder = {'state': state}

    def run_step(b):
        holder['state'], metrics = step(holder['state'], teacher_params, b)
        return metrics['loss']

    out = {
        'target': target,
        'draft': draft,
        'batch': batch,
        'seq_len': seq_len,
        'vocab': vocab,
        'divergence': divergence,
        'target_params': t_cfg.num_params,
        'draft_params': d_cfg.num_params,
    }
    out['teacher_fwd_s'] = median_time(lambda: teacher_fwd(teacher_params, data), repeats)
    out['draft_fwd_bwd_s'] = median_time(
        lambda: grad(holder['state'].params, t_logits, data), repeats
    )
    out['step_dataset_s'] = median_time(lambda: run_step(data), repeats)
    out['overhead'] = out['step_dataset_s'] / (out['teacher_fwd_s'] + out['draft_fwd_bwd_s'])

    gen = sources.Generator(
        plan.graphdef,
        prompt_len,
        max_new_tokens,
        SamplingConfig(1.0),
        None,
        mesh,
        tuple(rules),
        b_shard,
    )
    key = jax.random.key(0)
    generated = step_batch(gen(holder['state'].params, host, key))
    out['generate_s'] = median_time(
        lambda: gen(holder['state'].params, host, key)['tokens'], repeats
    )
    out['step_generated_s'] = median_time(lambda: run_step(generated), repeats)
    out['generation_share'] = out['generate_s'] / (out['generate_s'] + out['step_generated_s'])
    out['prompt_len'], out['max_new_tokens'] = prompt_len, max_new_tokens
    out['backend'] = jax.default_backend()
    return out


def format_table(r: dict) -> str:
    rows = [
        ('teacher forward', f'{r["teacher_fwd_s"] * 1e3:9.2f} ms'),
        ('draft forward+backward', f'{r["draft_fwd_bwd_s"] * 1e3:9.2f} ms'),
        ('distill step (dataset)', f'{r["step_dataset_s"] * 1e3:9.2f} ms'),
        ('  / (teacher fwd + draft fwd/bwd)', f'{r["overhead"]:9.3f} x'),
        ('on-policy generation', f'{r["generate_s"] * 1e3:9.2f} ms'),
        ('distill step (generated rows)', f'{r["step_generated_s"] * 1e3:9.2f} ms'),
        ('  generation share of step time', f'{100 * r["generation_share"]:8.1f} %'),
    ]
    head = (
        f'target {r["target"]} ({r["target_params"]:,} params), draft {r["draft"]} '
        f'({r["draft_params"]:,}), B={r["batch"]} T={r["seq_len"]}, on-policy '
        f'{r["prompt_len"]}+{r["max_new_tokens"]} tokens, {r["backend"]}'
    )
    return '\n'.join([head] + [f'  {name:<36}{value}' for name, value in rows])


def main(argv=None):
    args = parser().parse_args(argv)
    result = run(
        args.target,
        args.draft,
        args.batch,
        args.seq_len,
        args.vocab,
        args.prompt_len,
        args.max_new_tokens,
        args.divergence,
        args.repeats,
    )
    return cli.emit(result, format_table(result), args.out)


if __name__ == '__main__':
    main()
