"""The quickstart's route stage: the request-level router and the speculative cascade, measured.

Between "distill" (the student alone: fast, approximate) and "speculate" (exact) lies a curve.
On config.prompts_per_domain prompts per domain, split alternately into validation and held-out
prompts, every path answers each prompt at batch 1 (serve's shapes and sampling, so serve's
compiled programs come back from the persistent cache) with the same key per prompt: the target
alone, the target tier (the fastest exact path serve measured at batch 1: a speculative pair,
or the target alone when none was faster; config.tier names one instead), the student (the
distilled draft) alone, its first config.first_m tokens and its prefill (the same compiled
program with a run-time token limit), and the speculative cascade (target + student,
config.cascade_rule at k = config.cascade_k) at each lenience of config.cascade_lenience (one
program: the lenience is a run-time value). Calls are timed one by one, paths interleaved per
prompt, config.repeats times (medians). Then the target scores every answer (log-likelihood
per token, greedy agreement: specjax.evaluation.routing.token_scores) and the student its own
(the routing signals); specjax.evaluation.route_curves turns that table into the router's and
the cascade's curves with thresholds chosen on validation, figures on held-out prompts.

Entry point: `run(config, workdir, root)`; writes <workdir>/route.json.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import numpy as np

from specjax import jsonio
from specjax.checkpoint import load_model
from specjax.data import build_tokenizer
from specjax.evaluation import measure, route_curves, routing
from specjax.evaluation.pairs import draft_vocab_ids, stage_ngram_draft
from specjax.evaluation.prompts import make_prompts
from specjax.evaluation.serving import alone_inputs, alone_tokens
from specjax.evaluation.spec_eval_sampling import dynamic_sampling
from specjax.models import split
from specjax.parallel import make_mesh
from specjax.sampling import (
    Acceptance,
    NGramDraft,
    SamplingConfig,
    make_autoregressive_fn,
    make_speculative_fn,
)
from specjax.sampling.cascade import with_lenience

STUDENT = 'draft_distilled'


def choose_tier(serve: dict, tier: str) -> dict:
    """serve.json's batch-1 row of the target tier: `tier` ('fastest': the exact path with the
    least time per request, the target alone included) -> {'method', 'k'}."""
    b1 = min(r['batch_size'] for r in serve['rows'])
    rows = {
        r['method']: r
        for r in serve['rows']
        if r['batch_size'] == b1 and (r['method'] == 'target' or r['method'].startswith('spec_'))
    }
    if tier == 'fastest':
        tier = min(rows, key=lambda m: rows[m]['wall_s'])
    if tier not in rows:
        raise ValueError(f"config.route.tier={tier!r}: serve measured {sorted(rows)} or 'fastest'")
    return {'method': tier, 'k': rows[tier].get('k')}


def load_spec_draft(cfg, root: str, method: str, mesh, rules):
    """(draft model or NGramDraft, its vocabulary ids or None) of a spec_ method (serve's
    names: spec_<draft workdir>, spec_ngram: pairs.stage_ngram_draft(cfg))."""
    name = 'draft_' + method[len('spec_') :]
    if name == 'draft_ngram':
        return stage_ngram_draft(cfg), None
    if name == 'draft_feature':
        from specjax.distill.feature_mode import load_feature_draft

        return load_feature_draft(os.path.join(root, name))[0], draft_vocab_ids(
            os.path.join(root, name)
        )
    model = load_model(os.path.join(root, name), mesh=mesh, rules=rules)[0]
    return model, draft_vocab_ids(os.path.join(root, name))


def check_config(cfg) -> None:
    """ValueError naming the field before anything loads."""
    from specjax.sampling.cascade import CASCADE_RULES, check_lenience

    if int(cfg.prompts_per_domain) < 2:
        raise ValueError(
            f'config.route.prompts_per_domain={cfg.prompts_per_domain} must be >= 2 (one '
            'validation and one held-out prompt per domain at least)'
        )
    for field in ('first_m', 'repeats', 'max_new_tokens'):
        if int(cfg[field]) < 1:
            raise ValueError(f'config.route.{field} must be >= 1, got {cfg[field]!r}')
    unknown = [s for s in cfg.signals if s not in routing.SIGNALS]
    if unknown:
        raise ValueError(f'config.route.signals: {unknown} not in {routing.SIGNALS}')
    if cfg.cascade_rule and cfg.cascade_rule not in CASCADE_RULES:
        raise ValueError(f'config.route.cascade_rule={cfg.cascade_rule!r}: one of {CASCADE_RULES}')
    for a in cfg.cascade_lenience:
        check_lenience(a, 'config.route.cascade_lenience entries')
    if not float(cfg.quality_floor_nats) >= 0:
        raise ValueError(
            f'config.route.quality_floor_nats must be >= 0, got {cfg.quality_floor_nats}'
        )


def split_labels(domains) -> np.ndarray:
    """'validation' / 'held_out' per prompt: alternately within each domain (prompts come
    sorted by domain), so both splits hold every domain."""
    out = np.empty(len(domains), dtype=object)
    for d in dict.fromkeys(domains):
        rows = np.flatnonzero(np.asarray(domains) == d)
        out[rows] = np.where(np.arange(len(rows)) % 2 == 0, 'validation', 'held_out')
    return out


def _paths(cfg, root, mesh, rules, tier, serve_k):
    """({path: (sampler, params, vocabulary ids of its inputs)}, ((target graphdef, params),
    (student graphdef, params, ids)), the SamplingConfig, the target's vocab_size)."""
    target = load_model(os.path.join(root, 'target'), mesh=mesh, rules=rules)[0]
    student = load_model(os.path.join(root, STUDENT), mesh=mesh, rules=rules)[0]
    s_ids = draft_vocab_ids(os.path.join(root, STUDENT))
    (t_gd, t_params), (s_gd, s_params) = split(target), split(student)
    n = int(cfg.max_new_tokens)
    sampling = SamplingConfig(temperature=float(cfg.temperature))
    common = dict(
        max_new_tokens=n, sampling=sampling, eos_id=None, mesh=mesh, rules=rules,
        dynamic_sampling=dynamic_sampling(sampling, cfg.eval),
    )  # fmt: skip
    paths = {
        'target': (make_autoregressive_fn(t_gd, **common), [t_params], None),
        'student': (make_autoregressive_fn(s_gd, **common), [s_params], s_ids),
    }
    if tier['method'] != 'target':
        draft, d_ids = load_spec_draft(cfg, root, tier['method'], mesh, rules)
        d_gd, d_params = split(draft) if not isinstance(draft, NGramDraft) else (draft, ())
        fn = make_speculative_fn(
            t_gd, d_gd, num_draft_tokens=int(tier['k']),
            draft_vocab_ids=None if d_ids is None else tuple(d_ids), **common,
        )  # fmt: skip
        paths['tier'] = (fn, [t_params, d_params], None)
    if cfg.cascade_rule and len(cfg.cascade_lenience):
        acc = Acceptance(cfg.cascade_rule, cascade_lenience=float(cfg.cascade_lenience[0]))
        fn = make_speculative_fn(
            t_gd, s_gd, num_draft_tokens=int(cfg.cascade_k) or int(serve_k), acceptance=acc,
            draft_vocab_ids=None if s_ids is None else tuple(s_ids), **common,
        )  # fmt: skip
        paths['cascade'] = (fn, [t_params, s_params], None)
    models = ((t_gd, t_params), (s_gd, s_params, s_ids))
    return paths, models, sampling, target.config.vocab_size


def _compiled_calls(paths, cfg, prompts, target_vocab, rng):
    """Every program compiled ahead of time (side by side) -> ({name: (CompiledSampler, params,
    ids)} with the derived calls: the student's first m tokens and prefill, the cascade at each
    lenience), {program: compile seconds})."""
    first = lambda ids: alone_inputs(ids, target_vocab, prompts.tokens[:1])
    jobs = [
        (fn, params, first(ids), prompts.lengths[:1], rng) for fn, params, ids in paths.values()
    ]
    compiled = dict(zip(paths, measure.compile_samplers(jobs)))
    calls = {name: (compiled[name], params, ids) for name, (_, params, ids) in paths.items()}
    c, (fn, params, ids) = compiled['student'], paths['student']
    for name, limit in (('student_m', int(cfg.first_m)), ('student_prefill', 1)):
        calls[name] = (
            measure.CompiledSampler(c.compiled, fn.with_max_new(limit), 0.0),
            params,
            ids,
        )
    if 'cascade' in paths:
        c, (fn, params, ids) = compiled.pop('cascade'), paths['cascade']
        del calls['cascade']
        for j, a in enumerate(cfg.cascade_lenience):
            call = measure.CompiledSampler(c.compiled, with_lenience(fn, float(a)), c.compile_s)
            calls[f'cascade/{j}'] = (call, params, ids)
        compiled['cascade'] = c
    return calls, {name: c.compile_s for name, c in compiled.items()}


def _timed_answers(calls, prompts, target_vocab, repeats: int, rng):
    """Each call on each prompt at batch 1, paths interleaved per prompt (their order rotated),
    `repeats` times -> ({name: seconds [n] (medians)}, {name: (tokens [n, N] target ids,
    lengths [n], accepted [n] or None)}); prompt i's key is fold_in(rng, i) for every path."""
    names, n = list(calls), len(prompts)
    inputs = {name: alone_inputs(calls[name][2], target_vocab, prompts.tokens) for name in names}
    keys = [jax.random.fold_in(rng, i) for i in range(n)]

    def call(name, i):
        sampler, params, _ = calls[name]
        return sampler(*params, inputs[name][i : i + 1], prompts.lengths[i : i + 1], keys[i])

    seconds, outs = measure.per_prompt_times(call, names, n, repeats)
    answers = {}
    for name in names:
        ids = calls[name][2]
        tokens = np.concatenate([alone_tokens(ids, o.tokens) for o in outs[name]])
        lengths = np.concatenate([np.asarray(o.lengths) for o in outs[name]])
        acc = [o.stats.get('row_accepted') for o in outs[name]]
        accepted = None if acc[0] is None else np.concatenate([np.asarray(a) for a in acc])
        answers[name] = (tokens, lengths, accepted)
    return {name: np.median(t, axis=0) for name, t in seconds.items()}, answers


def build_table(prompts, labels, seconds, answers, t_scores, s_scores, cfg) -> dict:
    """The per-prompt table of specjax.evaluation.route_curves (its module docstring)."""
    seconds = dict(seconds, tier=seconds.get('tier', seconds['target']))
    table = {'split': labels, 'domain': np.asarray(prompts.domains)}
    table.update({f'time/{name}': t for name, t in seconds.items()})
    for name, sc in t_scores.items():
        table[f'll/{name}'] = sc['logp'].sum(1)
        table[f'count/{name}'] = sc['mask'].sum(1).astype(np.float64)
        table[f'agree/{name}'] = sc['agree'].sum(1).astype(np.float64)
        if name.startswith('cascade/'):
            table[f'accepted/{name}'] = answers[name][2].astype(np.float64)
    for signal in cfg.signals:
        if signal != 'probe':
            table[f'u/{signal}'] = routing.answer_uncertainty(
                s_scores['logp'], s_scores['mask'], signal, int(cfg.first_m)
            )
    return table


def add_probe(table: dict, features, floor: float, l2: float) -> dict:
    """Fits the probe on the validation prompts only (label: the student's answer within
    `floor` nats per token of the tier's) and adds u/probe for every prompt; returns the probe."""
    per_token = lambda name: table[f'll/{name}'] / np.maximum(table[f'count/{name}'], 1)
    good = per_token('tier') - per_token('student') <= floor
    val = np.asarray(table['split']) == 'validation'
    probe = routing.fit_probe(np.asarray(features)[val], good[val], l2=l2)
    table['u/probe'] = routing.probe_uncertainty(probe, features)
    return dict(probe, features=list(routing.FEATURES), validation_good=int(good[val].sum()))


def run(config, workdir: str, root: str) -> dict:
    started = time.perf_counter()
    check_config(config)
    mesh, rules = make_mesh(config.mesh), config.mesh.rules
    with open(os.path.join(root, 'serve', 'serve.json')) as f:
        serve = json.load(f)
    tier = choose_tier(serve, str(config.tier))
    paths, models, sampling, target_vocab = _paths(config, root, mesh, rules, tier, serve['k'])
    (t_gd, t_params), (s_gd, s_params, s_ids) = models
    ev = config.eval
    prompts = make_prompts(
        config.data, build_tokenizer(config.data), per_domain=int(config.prompts_per_domain),
        min_len=int(ev.prompt_len_min), max_len=int(ev.prompt_len_max), seed=config.seed,
    )  # fmt: skip
    labels = split_labels(prompts.domains)
    rng = jax.random.key(config.seed)
    calls, compile_s = _compiled_calls(paths, config, prompts, target_vocab, rng)
    seconds, answers = _timed_answers(calls, prompts, target_vocab, int(config.repeats), rng)
    scored = ['target', 'tier', 'student'] + [a for a in answers if a.startswith('cascade/')]
    t_scores = {
        name: routing.token_scores(
            t_gd, t_params, prompts.tokens, prompts.lengths, *answers[name][:2]
        )
        for name in scored
        if name in answers
    }
    t_scores.setdefault('tier', t_scores['target'])  # the target alone is the tier
    s_scores = routing.token_scores(
        s_gd, s_params, prompts.tokens, prompts.lengths, *answers['student'][:2], ids=s_ids
    )
    table = build_table(prompts, labels, seconds, answers, t_scores, s_scores, config)
    floor = float(config.quality_floor_nats)
    probe = None
    if 'probe' in config.signals:
        features = routing.prompt_features(s_scores, prompts.lengths)
        probe = add_probe(table, features, floor, float(config.probe_l2))
    leniences = tuple(float(a) for a in config.cascade_lenience) if config.cascade_rule else ()
    summary = route_curves.summarize(table, tuple(config.signals), leniences, floor, config.seed)
    if 'cascade' in summary:
        summary['cascade'].update(
            rule=config.cascade_rule, k=int(config.cascade_k) or int(serve['k']), exact=False
        )
    result = dict(
        summary,
        student=STUDENT,
        tier=tier,
        sampling=sampling.to_dict(),
        max_new_tokens=int(config.max_new_tokens),
        first_m=int(config.first_m),
        repeats=int(config.repeats),
        quality_floor_nats=floor,
        prompts={
            'count': len(prompts),
            **{s: int((labels == s).sum()) for s in route_curves.SPLITS},
            'per_domain': {str(d): int((prompts.domains == d).sum()) for d in set(prompts.domains)},
        },
        probe=probe,
        per_prompt={name: np.asarray(v).tolist() for name, v in table.items()},
        compile_s=compile_s,
        environment=measure.environment(),
        seconds=time.perf_counter() - started,
    )
    os.makedirs(workdir, exist_ok=True)
    jsonio.write_json(os.path.join(workdir, 'route.json'), result)
    if summary['best_signal']:
        best = summary['routers'][summary['best_signal']]
        p = best['curve'][best['chosen']]['held_out']
        logging.info(
            'route: %s at %s: %.3gx the target alone, student kept %.2f, cost %.3g nats/token',
            summary['best_signal'], best['curve'][best['chosen']]['threshold'],
            p['relative_latency'], p['kept_fraction'], p['quality_cost'],
        )  # fmt: skip
    return result
