"""The `cotrain` mode: a target and a draft trained together, as a loop Task.

Each step the target takes its cross-entropy step and the draft distills from the target's logits
of that same forward (before the target's update): one jitted call, one target forward. Both are
checkpointed (`params` / `model_config` and `draft_params` / `draft_config`).

The target starts from scratch, or (config.init.target_workdir) from step config.init.target_step
of a pretrain run: its params, optimizer state, step, rng and data position, so co-training
continues that run's schedule to config.train.steps with a fresh draft. The target's step is the
pretrain step, so its trajectory is the pretrain run's (same batches, same updates), and the
co-trained draft trains for train.steps - init.target_step steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import workdir as workdir_lib
from specjax.checkpoint import Checkpoints, abstract_with_shardings
from specjax.distill.config import (
    COTRAIN_SECTIONS,
    check_keys,
    loss_identity,
    sampling_config,
    validate_common,
)
from specjax.distill.evaluation import Evaluator
from specjax.distill.results import collect_results, finish_results
from specjax.distill.sources import DistillData, load_data
from specjax.distill.steps import CotrainState, LossSettings, jit_cotrain_step
from specjax.models import Transformer, TransformerConfig, abstract_model
from specjax.parallel import batch_sharding, make_mesh
from specjax.parallel.mesh import mesh_rules
from specjax.train.loop import Task, run_loop
from specjax.train.optimizer import learning_rate_schedule, make_optimizer
from specjax.train.runs import batch_placer, check_vocab, train_flops
from specjax.train.state import TrainState, state_shardings

# config.train fields that must equal the pretrain run's for co-training to continue its schedule.
_SCHEDULE_FIELDS = (
    'steps', 'batch_size', 'lr', 'warmup_steps', 'min_lr_ratio', 'b1', 'b2', 'eps',
    'weight_decay', 'grad_clip',
)  # fmt: skip


def plan_cotrain_state(target_cfg, draft_cfg, tx, seed: int, mesh, rules, draft_rules=None):
    """(target graphdef, draft graphdef, shardings, abstract, init) of a CotrainState.

    The draft's params and optimizer state follow `draft_rules` (None = `rules`)."""
    tgd, t_abs = abstract_model(target_cfg)
    dgd, d_abs = abstract_model(draft_cfg)
    ts = state_shardings(tx, t_abs, mesh, rules)
    ds = state_shardings(tx, d_abs, mesh, rules if draft_rules is None else draft_rules)
    shardings = CotrainState(
        step=ts.step,
        params=ts.params,
        opt_state=ts.opt_state,
        draft_params=ds.params,
        draft_opt_state=ds.opt_state,
        rng=ts.rng,
    )

    def init_fn(seed):
        k_target, k_draft, k_state = jax.random.split(jax.random.PRNGKey(seed), 3)
        _, tp = nnx.split(Transformer(target_cfg, rngs=nnx.Rngs(params=k_target)))
        _, dp = nnx.split(Transformer(draft_cfg, rngs=nnx.Rngs(params=k_draft)))
        return CotrainState(
            step=jnp.zeros((), jnp.int32),
            params=tp,
            opt_state=tx.init(tp),
            draft_params=dp,
            draft_opt_state=tx.init(dp),
            rng=k_state,
        )

    abstract = abstract_with_shardings(jax.eval_shape(init_fn, jnp.int32(seed)), shardings)

    def init():
        return jax.jit(init_fn, out_shardings=shardings)(jnp.int32(seed))

    return tgd, dgd, shardings, abstract, init


def check_init(config, identity: dict) -> tuple[str, int] | None:
    """(pretrain workdir, step) of config.init, checked before compiling; None = from scratch.

    ValueError naming the field when the step is missing or not below train.steps, the run's
    model, tokenizer or corpus differ (ConfigMismatch), or its schedule differs from config.train.
    """
    init = config.get('init') or {}
    check_keys(init, ('target_workdir', 'target_step'), 'config.init')
    workdir = init.get('target_workdir', '')
    if not workdir:
        return None
    step = int(init.get('target_step', -1))
    with Checkpoints(workdir, read_only=True) as ckpts:
        steps = ckpts.all_steps()
        if step not in steps or not 0 < step < int(config.train.steps):
            raise ValueError(
                f'config.init.target_step={step}: needs a checkpoint step of {workdir} (it has '
                f'{steps}) in (0, config.train.steps={config.train.steps})'
            )
        ckpts.check_identity(identity, step)
        saved = ckpts.metadata(step).get('config', {}).get('train', {})
    for field in _SCHEDULE_FIELDS:
        if field in saved and saved[field] != config.train[field]:
            raise ValueError(
                f'config.train.{field}={config.train[field]!r} but {saved[field]!r} in the '
                f'pretrain run {workdir} (config.init.target_workdir): co-training continues '
                'its schedule'
            )
    return workdir, step


def _init_from_pretrain(init, abstract: CotrainState, where: tuple[str, int], batches):
    """init with the target's state (and data position) read from a pretrain checkpoint."""
    workdir, step = where
    train_abstract = TrainState(
        step=abstract.step, params=abstract.params, opt_state=abstract.opt_state, rng=abstract.rng
    )

    def init_state():
        with Checkpoints(workdir, read_only=True) as ckpts:
            target, data_state, _ = ckpts.restore(train_abstract, step)
        batches.set_state(data_state)
        return init().replace(
            step=target.step, params=target.params, opt_state=target.opt_state, rng=target.rng
        )

    return init_state


def _check_pair(draft_cfg: TransformerConfig, target_cfg: TransformerConfig) -> None:
    """ValueError naming the fields unless draft and target share a vocabulary (vocab_size) and
    the target's max_len is at least the draft's."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f'config.draft.vocab_size={draft_cfg.vocab_size} differs from '
            f'config.model.vocab_size={target_cfg.vocab_size}: draft and target '
            'must share a vocabulary'
        )
    if target_cfg.max_len < draft_cfg.max_len:
        raise ValueError(
            f'config.model.max_len={target_cfg.max_len} is below '
            f'config.draft.max_len={draft_cfg.max_len}'
        )


def build_cotrain(config, data: DistillData):
    """Validates, plans target + draft state, jits the co-training step -> (Task, parts)."""
    draft_cfg = validate_common(config, 'cotrain', COTRAIN_SECTIONS)
    target_cfg = TransformerConfig.from_dict(config.model)
    check_vocab(draft_cfg, data, 'config.draft')
    check_vocab(target_cfg, data, 'config.model')
    _check_pair(draft_cfg, target_cfg)
    sampling = sampling_config(config)
    mesh = make_mesh(config.mesh)
    rules, draft_rules = mesh_rules(config.mesh)
    tx = make_optimizer(config.train)
    tgd, dgd, shardings, abstract, init = plan_cotrain_state(
        target_cfg, draft_cfg, tx, config.seed, mesh, rules, draft_rules
    )
    b_sharding = batch_sharding(mesh, rules)
    step_fn = jit_cotrain_step(
        tgd,
        dgd,
        tx,
        learning_rate_schedule(config.train),
        LossSettings.from_config(config.distill),
        shardings,
        b_sharding,
        mesh,
    )
    evaluator = Evaluator(
        dgd,
        tgd,
        eval_batches=data.eval_batches,
        domains=data.domains,
        distill_cfg=config.distill,
        sampling=sampling,
        eos_id=data.eos_id,
        mesh=mesh,
        rules=rules,
        draft_rules=draft_rules,
        batch_sharding=b_sharding,
        seed=config.seed,
    )
    target_identity = {
        'model_config': target_cfg.to_dict(),
        'tokenizer': data.tokenizer,
        'corpus': data.corpus,
    }
    where = check_init(config, target_identity)
    if where is not None:
        init = _init_from_pretrain(init, abstract, where, data.train)
    put = batch_placer(b_sharding, ('tokens', 'positions', 'segment_ids'))
    task = Task(
        mode='cotrain',
        init_state=init,
        abstract_state=abstract,
        step=step_fn,
        batches=data.train,
        put_batch=put,
        evaluate=lambda state: evaluator(state.draft_params, state.params),
        identity=dict(
            target_identity, draft_config=draft_cfg.to_dict(), distill=loss_identity(config)
        ),
        metadata={
            'config': config,
            'num_params': target_cfg.num_params,
            'draft_num_params': draft_cfg.num_params,
        },
        tokens_per_step=config.train.batch_size * config.data.seq_len,
        finite_part=lambda state: (state.params, state.draft_params),
    )
    return task, dict(
        start_step=0 if where is None else where[1],  # steps before this run's co-training
        evaluator=evaluator,
        draft_cfg=draft_cfg,
        target_cfg=target_cfg,
        step_fn=step_fn,
        mesh=mesh,
        rules=rules,
        graphdefs=(tgd, dgd),
    )


def run_cotrain(config, workdir: str, *, data: DistillData | None = None, on_step=None) -> dict:
    """Co-trains config.model (target) and config.draft in `workdir` (locked); see module doc."""
    validate_common(config, 'cotrain', COTRAIN_SECTIONS)
    with workdir_lib.opened(workdir, 'cotrain') as workdir:
        return _run_cotrain(config, workdir, data, on_step)


def _run_cotrain(config, workdir, data, on_step) -> dict:
    data = load_data(config) if data is None else data
    task, parts = build_cotrain(config, data)
    result = run_loop(task, workdir, config.train, on_step=on_step)
    results = collect_results(
        config,
        result,
        parts['evaluator'],
        result.state.draft_params,
        result.state.params,
        {
            'num_params_draft': parts['draft_cfg'].num_params,
            'num_params_target': parts['target_cfg'].num_params,
            'train_flops': train_flops(  # this run's co-training steps only
                [parts['target_cfg'], parts['draft_cfg']],
                seq_len=config.data.seq_len,
                tokens=(result.step - parts['start_step']) * task.tokens_per_step,
            ),
        },
    )
    return finish_results(workdir, results, config)
