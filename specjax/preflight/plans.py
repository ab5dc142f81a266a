"""Memory plans per mode: which models, optimizer states and caches a run holds, and its step.

Each `plan_<mode>(config, mesh, compile_step)` reads only the config (and, for checkpoints, their
metadata: no arrays), builds abstract arrays with the run's shardings and returns a MemoryPlan.
The step lowered for temporaries is the mode's own jitted step (train, distill, co-train) or,
for spec_eval, the speculative sampler at the largest k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import TransformerConfig
from specjax.parallel.mesh import mesh_rules
from specjax.parallel.sharding import batch_sharding, param_shardings
from specjax.preflight.memory_plan import (
    MemoryPlan,
    abstract_params,
    cache_item,
    compiled_temporaries,
    optimizer_item,
    params_item,
)


def _int_batch(shape, sharding, keys, dtypes=None):
    dtypes = dtypes or {}
    return {
        k: jax.ShapeDtypeStruct(shape, dtypes.get(k, jnp.int32), sharding=sharding) for k in keys
    }


def _meta_config(workdir: str, field: str, key: str = 'model_config') -> TransformerConfig:
    """The TransformerConfig recorded in `workdir`'s latest checkpoint (metadata only)."""
    from specjax.checkpoint import Checkpoints

    if not workdir:
        raise ValueError(f"config.{field} is empty: the planner needs that model's config")
    try:
        with Checkpoints(workdir, read_only=True) as ckpts:
            meta = ckpts.metadata()
    except FileNotFoundError as e:
        raise ValueError(f'config.{field}={workdir!r}: {e}') from None
    if key not in meta:
        raise ValueError(f'config.{field}={workdir!r}: its checkpoint has no {key!r} metadata')
    return TransformerConfig.from_dict(meta[key])


def _mesh_shape(mesh) -> dict[str, int]:
    return {name: int(size) for name, size in mesh.shape.items()}


def plan_pretrain(config, mesh, compile_step: bool = True) -> MemoryPlan:
    from specjax.train.optimizer import learning_rate_schedule, make_optimizer
    from specjax.train.state import plan_train_state
    from specjax.train.steps import BATCH_KEYS, jit_train_step

    rules, draft_rules = mesh_rules(config.mesh)
    cfg = TransformerConfig.from_dict(config.model)
    tx = make_optimizer(config.train)
    items = (params_item('model', cfg, mesh, rules), optimizer_item('model', cfg, tx, mesh, rules))
    temporaries = None
    if compile_step:
        plan = plan_train_state(cfg, tx, config.seed, mesh, rules)
        bs = batch_sharding(mesh, rules)
        step = jit_train_step(
            plan.graphdef, tx, learning_rate_schedule(config.train), plan.shardings, bs, mesh
        )
        batch = _int_batch((config.train.batch_size, config.data.seq_len), bs, BATCH_KEYS)
        temporaries = compiled_temporaries(lambda: step.lower(plan.abstract, batch))
    return MemoryPlan('pretrain', _mesh_shape(mesh), items, temporaries)


def _step_batch(batch_size: int, seq_len: int, bs):
    from specjax.distill.steps import STEP_KEYS

    masks = {'loss_mask': jnp.bool_, 'ce_mask': jnp.bool_}
    batch = _int_batch((batch_size, seq_len), bs, STEP_KEYS, masks)
    for k in masks:  # next-token masks are one shorter than the rows
        batch[k] = jax.ShapeDtypeStruct((batch_size, seq_len - 1), jnp.bool_, sharding=bs)
    return batch


def plan_distill(config, mesh, compile_step: bool = True) -> MemoryPlan:
    from specjax.distill.steps import LossSettings, jit_distill_step
    from specjax.train.optimizer import learning_rate_schedule, make_optimizer
    from specjax.train.state import plan_train_state

    rules, draft_rules = mesh_rules(config.mesh)
    draft = TransformerConfig.from_dict(config.draft)
    teacher = _meta_config(config.distill.teacher_workdir, 'distill.teacher_workdir')
    tx = make_optimizer(config.train)
    d = config.distill
    items = [
        params_item('teacher (frozen)', teacher, mesh, rules),
        params_item('draft', draft, mesh, draft_rules),
        optimizer_item('draft', draft, tx, mesh, draft_rules),
    ]
    generated = d.prompt_len + d.max_new_tokens
    if d.source != 'dataset':  # generated continuations: a sampler holds caches of its models
        batch = config.train.batch_size
        capacity = generated + 1
        items.append(cache_item('draft', draft, batch, capacity, mesh, draft_rules))
        items.append(cache_item('teacher', teacher, batch, capacity, mesh, rules))
    temporaries = None
    if compile_step:
        plan = plan_train_state(draft, tx, config.seed, mesh, draft_rules)
        teacher_gd, teacher_params = abstract_params(teacher)
        t_shardings = param_shardings(mesh, teacher_params, rules)
        bs = batch_sharding(mesh, rules)
        step = jit_distill_step(
            plan.graphdef,
            teacher_gd,
            tx,
            learning_rate_schedule(config.train),
            LossSettings.from_config(d),
            plan.shardings,
            t_shardings,
            bs,
            mesh,
        )
        seq = config.data.seq_len if d.source == 'dataset' else generated
        abstract_teacher = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            teacher_params,
            t_shardings,
        )
        batch = _step_batch(config.train.batch_size, seq, bs)
        temporaries = compiled_temporaries(
            lambda: step.lower(plan.abstract, abstract_teacher, batch)
        )
    return MemoryPlan('distill', _mesh_shape(mesh), tuple(items), temporaries)


def plan_cotrain(config, mesh, compile_step: bool = True) -> MemoryPlan:
    from specjax.distill.cotrain import plan_cotrain_state
    from specjax.distill.steps import LossSettings, jit_cotrain_step
    from specjax.train.optimizer import learning_rate_schedule, make_optimizer

    rules, draft_rules = mesh_rules(config.mesh)
    target = TransformerConfig.from_dict(config.model)
    draft = TransformerConfig.from_dict(config.draft)
    tx = make_optimizer(config.train)
    items = (
        params_item('target', target, mesh, rules),
        optimizer_item('target', target, tx, mesh, rules),
        params_item('draft', draft, mesh, draft_rules),
        optimizer_item('draft', draft, tx, mesh, draft_rules),
    )
    temporaries = None
    if compile_step:
        tgd, dgd, shardings, abstract, _ = plan_cotrain_state(
            target, draft, tx, config.seed, mesh, rules, draft_rules
        )
        bs = batch_sharding(mesh, rules)
        step = jit_cotrain_step(
            tgd,
            dgd,
            tx,
            learning_rate_schedule(config.train),
            LossSettings.from_config(config.distill),
            shardings,
            bs,
            mesh,
        )
        batch = _step_batch(config.train.batch_size, config.data.seq_len, bs)
        temporaries = compiled_temporaries(lambda: step.lower(abstract, batch))
    return MemoryPlan('cotrain', _mesh_shape(mesh), items, temporaries)


def plan_spec_eval(config, mesh, compile_step: bool = True) -> MemoryPlan:
    from specjax.sampling import SamplingConfig, make_speculative_fn

    rules, draft_rules = mesh_rules(config.mesh)
    if config.random_init:
        target = TransformerConfig.from_dict(config.model)
        draft = TransformerConfig.from_dict(config.draft)
    else:
        target = _meta_config(config.target_workdir, 'target_workdir')
        draft = _meta_config(config.draft_workdir, 'draft_workdir', config.draft_config_key)
    ev = config.eval
    k = max(int(x) for x in ev.ks)
    batch, width, max_new = int(ev.batch_size), int(ev.prompt_len_max), int(ev.max_new_tokens)
    capacity = width + max_new + k + 1  # what the speculative sampler allocates
    items = (
        params_item('target', target, mesh, rules),
        params_item('draft', draft, mesh, draft_rules),
        cache_item('target', target, batch, capacity, mesh, rules),
        cache_item('draft', draft, batch, capacity, mesh, draft_rules),
    )
    temporaries = None
    if compile_step:
        t_gd, t_params = abstract_params(target)
        d_gd, d_params = abstract_params(draft)
        s = ev.samplings[0]
        sampler = make_speculative_fn(
            t_gd,
            d_gd,
            num_draft_tokens=k,
            max_new_tokens=max_new,
            sampling=SamplingConfig(float(s[0]), int(s[1]), float(s[2])),
            mesh=mesh,
            rules=rules,
            draft_rules=draft_rules,
        )
        bs = batch_sharding(mesh, rules)
        prompts = jax.ShapeDtypeStruct((batch, width), jnp.int32, sharding=bs)
        lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=bs)
        key = jax.eval_shape(lambda: jax.random.key(0))
        temporaries = compiled_temporaries(
            lambda: sampler.lower_abstract(t_params, d_params, prompts, lengths, key)
        )
    return MemoryPlan('spec_eval', _mesh_shape(mesh), items, temporaries)


PLANS = {
    'pretrain': plan_pretrain,
    'distill': plan_distill,
    'cotrain': plan_cotrain,
    'spec_eval': plan_spec_eval,
}


def plan_for_config(config, mesh=None, compile_step: bool = True) -> MemoryPlan:
    """The MemoryPlan of `config` (its mode decides the models) on `mesh` (default: config's)."""
    from specjax.parallel.mesh import make_mesh

    mode = config.get('mode')
    if mode not in PLANS:
        raise ValueError(f'config.mode={mode!r}: the planner knows {sorted(PLANS)}')
    mesh = make_mesh(config.mesh) if mesh is None else mesh
    return PLANS[mode](config, mesh, compile_step)
