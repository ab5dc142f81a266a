"""The `distill` mode as a Task for the shared training loop: a draft learns from a frozen target
checkpoint (config.distill.teacher_workdir) and writes <workdir>/results.json with the keys of
specjax.distill.evaluation (alpha_T1, acceptance_k4_T1, tau_k4_T1, predicted_speedup_k4_T1,
draft_val_loss, ...; see specjax.distill.results).
"""

from __future__ import annotations

import jax

from specjax import workdir as workdir_lib
from specjax.distill import sources
from specjax.distill.config import (
    DISTILL_SECTIONS,
    loss_identity,
    sampling_config,
    validate_common,
)
from specjax.distill.evaluation import Evaluator
from specjax.distill.results import collect_results, finish_results
from specjax.distill.sources import DistillData, load_data
from specjax.distill.steps import (
    STEP_KEYS,
    LossSettings,
    jit_distill_step,
    step_batch,
)
from specjax.distill.teacher import Teacher, check_compatible, load_teacher, precheck
from specjax.parallel import batch_sharding, make_mesh, param_shardings
from specjax.parallel.mesh import mesh_rules
from specjax.train.loop import Task, run_loop
from specjax.train.optimizer import learning_rate_schedule, make_optimizer
from specjax.train.runs import batch_placer, check_vocab, train_flops
from specjax.train.state import plan_train_state


class DistillStepper:
    """Task.step for distill: picks the step's source, generates if needed, runs the jitted step.

    Host batches come straight from the data iterator (Task.put_batch is the identity); the
    step index is read from the state once and then counted here, so the source choice and the
    generation key depend only on (seed, step).
    """

    def __init__(self, step_fn, teacher: Teacher, generators, b_sharding, distill_cfg, seed):
        self.step_fn, self.teacher, self.generators = step_fn, teacher, generators
        self.put, self.d, self.seed = batch_placer(b_sharding, STEP_KEYS), distill_cfg, seed
        self._step = None

    def make_batch(self, state, host_batch, kind):
        if kind == 'dataset':
            return self.put(sources.dataset_batch(host_batch))
        params = self.teacher.params if kind == 'teacher' else state.params
        key = sources.generation_key(self.seed, self._step)
        return step_batch(self.generators[kind](params, host_batch, key))

    def kind(self, step: int) -> str:
        return sources.source_for_step(
            self.d.source,
            step,
            seed=self.seed,
            mixture_lambda=float(self.d.mixture_lambda),
            mixture_base=self.d.mixture_base,
        )

    def __call__(self, state, host_batch):
        if self._step is None:
            self._step = int(jax.device_get(state.step))
        kind = self.kind(self._step)
        batch = self.make_batch(state, host_batch, kind)
        self._step += 1
        state, metrics = self.step_fn(state, self.teacher.params, batch)
        metrics = dict(metrics, on_policy=float(kind == 'on_policy'))
        return state, metrics


def _load_checked_teacher(config, draft_cfg, data: DistillData, mesh, rules) -> Teacher:
    """The frozen teacher of config.distill on `mesh` (its params sharded by `rules`), checked
    against the draft (check_compatible) and long enough for training and generation.

    ValueError when the teacher's max_len is below config.data.seq_len or below
    distill.prompt_len + max_new_tokens + final_spec_k + 1.
    """
    d = config.distill
    teacher = load_teacher(d.teacher_workdir, int(d.teacher_step), mesh=mesh, rules=rules)
    check_compatible(teacher, draft_cfg, data.tokenizer)
    need = max(config.data.seq_len, d.prompt_len + d.max_new_tokens + d.final_spec_k + 1)
    if teacher.config.max_len < need:
        raise ValueError(
            f"the teacher's max_len={teacher.config.max_len} is below {need} "
            '(config.data.seq_len / distill.prompt_len + max_new_tokens + k + 1)'
        )
    return teacher


def _generators(
    teacher: Teacher, draft_graphdef, d, sampling, eos_id: int, mesh, rules, draft_rules, b_sharding
) -> dict:
    """{'teacher': ..., 'on_policy': ...}: the sources.Generator of each generated source, the
    teacher's under `rules` and the draft's (`draft_graphdef`) under `draft_rules`, each taking
    d.prompt_len prompt tokens and generating up to d.max_new_tokens."""
    generators = {}
    for kind, gd, r in (
        ('teacher', teacher.graphdef, rules),
        ('on_policy', draft_graphdef, draft_rules),
    ):
        generators[kind] = sources.Generator(
            gd, d.prompt_len, d.max_new_tokens, sampling, eos_id, mesh, r, b_sharding
        )
    return generators


def build_distill(config, data: DistillData):
    """Validates, loads the teacher, plans the draft state, jits the step -> (Task, parts)."""
    draft_cfg = validate_common(config, 'distill', DISTILL_SECTIONS)
    check_vocab(draft_cfg, data, 'config.draft')
    sampling = sampling_config(config)
    mesh = make_mesh(config.mesh)
    rules, draft_rules = mesh_rules(config.mesh)  # the teacher's, the draft's
    d = config.distill
    teacher = _load_checked_teacher(config, draft_cfg, data, mesh, rules)
    tx = make_optimizer(config.train)
    plan = plan_train_state(draft_cfg, tx, config.seed, mesh, draft_rules)
    b_sharding = batch_sharding(mesh, rules)
    t_shardings = param_shardings(mesh, teacher.params, rules)
    step_fn = jit_distill_step(
        plan.graphdef,
        teacher.graphdef,
        tx,
        learning_rate_schedule(config.train),
        LossSettings.from_config(d),
        plan.shardings,
        t_shardings,
        b_sharding,
        mesh,
    )
    generators = _generators(
        teacher, plan.graphdef, d, sampling, data.eos_id, mesh, rules, draft_rules, b_sharding
    )
    evaluator = Evaluator(
        plan.graphdef,
        teacher.graphdef,
        eval_batches=data.eval_batches,
        domains=data.domains,
        distill_cfg=d,
        sampling=sampling,
        eos_id=data.eos_id,
        mesh=mesh,
        rules=rules,
        draft_rules=draft_rules,
        batch_sharding=b_sharding,
        seed=config.seed,
    )
    stepper = DistillStepper(step_fn, teacher, generators, b_sharding, d, config.seed)
    task = Task(
        mode='distill',
        init_state=plan.init,
        abstract_state=plan.abstract,
        step=stepper,
        batches=data.train,
        put_batch=lambda batch: batch,
        evaluate=(lambda state: evaluator(state.params, teacher.params)),
        identity={
            'model_config': draft_cfg.to_dict(),
            'tokenizer': data.tokenizer,
            'corpus': data.corpus,
            'teacher': teacher.identity(),
            'distill': loss_identity(config),
        },
        metadata={'config': config, 'num_params': draft_cfg.num_params},
        tokens_per_step=config.train.batch_size * config.data.seq_len,
    )
    return task, dict(
        teacher=teacher,
        evaluator=evaluator,
        draft_cfg=draft_cfg,
        plan=plan,
        stepper=stepper,
        step_fn=step_fn,
        mesh=mesh,
        rules=rules,
        draft_rules=draft_rules,
    )


def run_distill(config, workdir: str, *, data: DistillData | None = None, on_step=None) -> dict:
    """Distills a draft from the frozen target at config.distill.teacher_workdir into `workdir`.

    Resumes from <workdir>/checkpoints; returns the results dict (also <workdir>/results.json).
    Holds the workdir lock for the whole run.
    """
    draft_cfg = validate_common(config, 'distill', DISTILL_SECTIONS)
    precheck(config, draft_cfg, data_config=data is None)  # before any tokenizer is built
    with workdir_lib.opened(workdir, 'distill') as workdir:
        return _run_distill(config, workdir, data, on_step)


def _run_distill(config, workdir, data, on_step) -> dict:
    data = load_data(config) if data is None else data
    task, parts = build_distill(config, data)
    result = run_loop(task, workdir, config.train, on_step=on_step)
    teacher = parts['teacher']
    results = collect_results(
        config,
        result,
        parts['evaluator'],
        result.state.params,
        teacher.params,
        {
            'teacher_workdir': teacher.workdir,
            'teacher_step': teacher.step,
            'num_params_draft': parts['draft_cfg'].num_params,
            'num_params_target': teacher.config.num_params,
            'train_flops': train_flops(
                [parts['draft_cfg']],
                [teacher.config],
                seq_len=config.data.seq_len,
                tokens=result.step * task.tokens_per_step,
            ),
        },
    )
    return finish_results(workdir, results, config)
