"""Target pretraining: next-token cross-entropy on the packed corpus, as a Task for run_loop."""

from __future__ import annotations

import math

import jax
import numpy as np

from specjax import workdir as workdir_lib
from specjax.data import default_data_config
from specjax.models import TransformerConfig
from specjax.parallel import batch_sharding, logical_to_spec, make_mesh
from specjax.train import runs
from specjax.train.config import check_keys, validate_train_config
from specjax.train.loop import LoopResult, Task, run_loop
from specjax.train.optimizer import learning_rate_schedule, make_optimizer
from specjax.train.state import plan_train_state
from specjax.train.steps import BATCH_KEYS, jit_eval_step, jit_train_step

CONFIG_SECTIONS = ('mode', 'seed', 'model', 'data', 'train', 'mesh')


PretrainData = runs.RunData  # the name pretrain's callers and tests use


def validate_config(config) -> TransformerConfig:
    """Checks a pretrain config before anything is built; errors name the field and value."""
    check_keys(config, CONFIG_SECTIONS, 'config')
    validate_train_config(config.train)
    model_cfg = TransformerConfig.from_dict(config.model)
    check_keys(config.data, default_data_config().keys(), 'config.data')
    if 'seq_len' not in config.data:
        raise ValueError('config.data.seq_len is missing')
    seq_len = config.data.seq_len
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f'config.data.seq_len must be an int >= 2, got {seq_len!r}')
    if seq_len > model_cfg.max_len:
        raise ValueError(
            f'config.data.seq_len={seq_len} is above config.model.max_len={model_cfg.max_len}'
        )
    runs.check_mesh_config(config.mesh)
    if config.train.batch_size % jax.process_count():
        raise ValueError(
            f'config.train.batch_size={config.train.batch_size} does not divide over '
            f'{jax.process_count()} processes'
        )
    return model_cfg


def check_batch_divides(batch_size: int, mesh, rules) -> None:
    """ValueError unless the global batch splits evenly over the mesh axes of 'batch'."""
    axes = logical_to_spec(('batch',), rules)[0]
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    shards = math.prod(mesh.shape[a] for a in axes)
    if batch_size % shards:
        raise ValueError(
            f'config.train.batch_size={batch_size} does not divide over the {shards} devices of '
            f'mesh axes {axes} that shard the batch'
        )


def make_evaluate(eval_step, eval_batches, domains):
    """state -> {'loss', 'perplexity', 'loss/<domain>', 'perplexity/<domain>', 'targets'}."""

    def evaluate(state) -> dict[str, float]:
        outs = [eval_step(state.params, b) for b in eval_batches]
        outs = jax.device_get(outs)
        loss_sum = sum(float(o['loss_sum']) for o in outs)
        count = sum(float(o['count']) for o in outs)
        dom_sum = np.sum([np.asarray(o['domain_loss_sum'], np.float64) for o in outs], axis=0)
        dom_count = np.sum([np.asarray(o['domain_count'], np.float64) for o in outs], axis=0)
        loss = loss_sum / max(count, 1.0)
        out = {'loss': loss, 'perplexity': math.exp(min(loss, 700.0)), 'targets': count}
        for name, s, c in zip(domains, dom_sum, dom_count):
            if c > 0:
                out[f'loss/{name}'] = s / c
                out[f'perplexity/{name}'] = math.exp(min(s / c, 700.0))
        return out

    return evaluate


def build_task(config, data: PretrainData) -> tuple[Task, TransformerConfig]:
    """Validates, plans the sharded state and jits the steps (compilation happens lazily)."""
    model_cfg = validate_config(config)
    runs.check_vocab(model_cfg, data, 'config.model')
    mesh = make_mesh(config.mesh)
    rules = config.mesh.rules
    check_batch_divides(config.train.batch_size, mesh, rules)
    tx = make_optimizer(config.train)
    plan = plan_train_state(model_cfg, tx, config.seed, mesh, rules)
    b_sharding = batch_sharding(mesh, rules)
    step = jit_train_step(
        plan.graphdef, tx, learning_rate_schedule(config.train), plan.shardings, b_sharding, mesh
    )
    put = runs.batch_placer(b_sharding, BATCH_KEYS)
    evaluate = None
    if data.eval_batches:
        eval_step = jit_eval_step(
            plan.graphdef, plan.shardings.params, b_sharding, mesh, max(len(data.domains), 1)
        )
        evaluate = make_evaluate(eval_step, [put(b) for b in data.eval_batches], data.domains)
    task = Task(
        mode='pretrain',
        init_state=plan.init,
        abstract_state=plan.abstract,
        step=step,
        batches=data.train,
        put_batch=put,
        evaluate=evaluate,
        identity={
            'model_config': model_cfg.to_dict(),
            'tokenizer': data.tokenizer,
            'corpus': data.corpus,
        },
        metadata={'config': config, 'num_params': model_cfg.num_params},
        tokens_per_step=config.train.batch_size * config.data.seq_len,
    )
    return task, model_cfg


def pretrain(config, workdir: str, *, data: PretrainData | None = None, on_step=None) -> dict:
    """Trains a target model per `config` in `workdir` (resuming if it has checkpoints).

    Returns the results dict (also <workdir>/results.json unless preempted): validation loss and
    perplexity (overall and per domain), the corpus baselines, the checkpoint location, the
    config and its hash. Holds the workdir lock for the whole run.
    """
    validate_config(config)
    with workdir_lib.opened(workdir, 'pretrain') as workdir:
        return _pretrain(config, workdir, data, on_step)


def _pretrain(config, workdir, data, on_step) -> dict:
    if data is None:
        data = runs.load_data(config, num_eval_batches=config.train.eval_batches, baselines=True)
    task, model_cfg = build_task(config, data)
    result: LoopResult = run_loop(task, workdir, config.train, on_step=on_step)
    results = {
        'step': result.step,
        'preempted': result.preempted,
        'num_params': model_cfg.num_params,
        'train_flops': runs.train_flops(
            [model_cfg], seq_len=config.data.seq_len, tokens=result.step * task.tokens_per_step
        ),
        'eval': result.eval,
        'baselines': data.baselines,
        'checkpoint_dir': result.checkpoint_dir,
        'checkpoint_step': result.checkpoint_step,
    }
    if result.preempted:
        if jax.process_index() == 0:
            print(
                f'preempted: {result.stopped or f"checkpoint {result.checkpoint_dir}"}; '
                'rerun the same command to resume',
                flush=True,
            )
        return results
    path = None
    if jax.process_index() == 0:
        path = workdir_lib.write_results(workdir, 'pretrain', results, config)
    val = result.eval.get('loss', float('nan'))
    lines = [f'validation loss {val:.4f} nats (perplexity {math.exp(min(val, 700)):.2f})']
    for name, value in data.baselines.items():
        lines.append(f'{name} baseline {value:.4f} nats')
    lines.append(f'checkpoint: {result.checkpoint_dir} step {result.checkpoint_step}')
    lines.append(f'results: {path}')
    if jax.process_index() == 0:
        print('\n'.join(lines), flush=True)
    return results
