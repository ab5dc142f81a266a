"""spec_eval mode: autoregressive vs speculative decoding of a target and draft, measured.

For every sampling setting of config.eval.samplings: the target decodes the prompts alone
(autoregressive), then with the draft for every k in config.eval.ks (or the setting's own ks).
Reported per point: the acceptance statistics of specjax.sampling.stats (overall and bucketed by
domain, prompt length and generated length), wall time per generated token (compiled ahead of
time, warm-up excluded), measured speedup = autoregressive time per token / speculative time per
token, predicted speedup = tau / (k c + v(k)) (specjax.sampling.stats.round_cost) with c and v(k)
measured here (specjax.sampling.calibrate), their ratio, the optimal k, and peak memory. alpha is
the configured acceptance rule's acceptance probability (config.eval.acceptance; sum min(p, q)
for `probabilistic`, p(argmax q) for `argmax_draft`, ...: stats.alpha_per_position), measured
from logits on the target's own autoregressive samples of the same prompts (the distribution
speculative decoding reproduces), and E[tau], the predicted speedups and the optimal k use it.

Entry point: `run(config, workdir)` (mode 'spec_eval'); writes <workdir>/spec_eval.json and
<workdir>/results.json, holding the workdir lock, and refuses (before loading anything) a workdir
whose results were written by another mode (e.g. a training workdir). A rerun keeps the previous
files beside the new ones (spec_eval.prev.json, results.prev.json, numbered: workdir.write_kept).
The models' checkpoints are verified as they load (a corrupt step is refused, naming its folder).
One sampling setting's points: specjax.evaluation.spec_eval_sampling; results.json and the
printed table: specjax.evaluation.spec_eval_summary.
"""

from __future__ import annotations

import json
import logging
import time

from specjax import jsonio
from specjax import workdir as workdir_lib
from specjax.data import build_tokenizer
from specjax.evaluation import intervals, measure
from specjax.evaluation.pairs import FEATURE_CONFIG_KEY, draft_vocab_ids, load_models, ngram_draft
from specjax.evaluation.prompts import make_prompts
from specjax.evaluation.spec_eval_sampling import BUCKET_KEYS, acceptance, evaluate_sampling
from specjax.evaluation.spec_eval_summary import headline, table_markdown
from specjax.evaluation.tables import sampling_label
from specjax.models import split
from specjax.parallel import is_main_process, make_mesh
from specjax.parallel.mesh import mesh_rules
from specjax.sampling import SamplingConfig
from specjax.sampling.calibrate import calibrate
from specjax.sampling.drafters import split_draft


def _check_ks(ks, where: str) -> tuple[int, ...]:
    if (
        not isinstance(ks, tuple | list)
        or not ks
        or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks)
    ):
        raise ValueError(f'{where} must be a non-empty tuple of positive ints, got {ks!r}')
    return tuple(int(k) for k in ks)


def _check_eval(ev) -> tuple[list[tuple[SamplingConfig, tuple[int, ...]]], tuple[int, ...]]:
    """([(sampling, its ks)], every k): an entry's optional 4th element replaces config.eval.ks
    for that setting (e.g. the k sweep at T = 0 and 1 only, one k elsewhere)."""
    for field in ('max_new_tokens', 'batch_size', 'prompts_per_domain'):
        if int(ev[field]) < 1:
            raise ValueError(f'config.eval.{field} must be >= 1, got {ev[field]!r}')
    ks = _check_ks(ev.ks, 'config.eval.ks')
    samplings = []
    if not isinstance(ev.samplings, tuple | list) or not all(
        isinstance(s, tuple | list) for s in ev.samplings
    ):
        raise ValueError(
            'config.eval.samplings must be a tuple of (temperature, top_k, top_p) tuples, got '
            f'{ev.samplings!r} (one setting needs a trailing comma: ((0.0, 0, 1.0),))'
        )
    for s in ev.samplings:
        if len(s) not in (3, 4):
            raise ValueError(
                f'config.eval.samplings entries are (temperature, top_k, top_p[, ks]), got {s!r}'
            )
        own = _check_ks(s[3], f'config.eval.samplings entry {s!r}: its ks') if len(s) > 3 else ks
        samplings.append((SamplingConfig(float(s[0]), int(s[1]), float(s[2])), own))
    if not samplings:
        raise ValueError('config.eval.samplings is empty')
    acceptance(ev)
    return samplings, tuple(sorted(set().union(*(own for _, own in samplings))))


def model_max_lens(config) -> dict[str, tuple[int, str]]:
    """{'target'|'draft': (max_len, where it comes from)}, read from configs or checkpoint metadata
    (no weights loaded)."""
    if config.random_init:
        out = {'target': (int(config.model.max_len), 'config.model.max_len')}
        if ngram_draft(config) is None:
            out['draft'] = (int(config.draft.max_len), 'config.draft.max_len')
        return out
    from specjax.checkpoint import Checkpoints

    out = {}
    models = [('target', 'target_workdir', 'model_config')]
    if ngram_draft(config) is None:  # an n-gram draft has no max_len
        models.append(('draft', 'draft_workdir', config.draft_config_key))
    for name, field, key in models:
        if not config.get(field):
            raise ValueError(f'config.{field} is empty; set it or config.random_init=True')
        ckpts = Checkpoints(config[field], read_only=True)
        try:
            _, meta = ckpts.newest_readable(ckpts.metadata)  # as load_model: skip broken steps
        finally:
            ckpts.close()
        if name == 'draft' and FEATURE_CONFIG_KEY in meta:  # a feature draft: its target's
            meta = {key: meta[FEATURE_CONFIG_KEY]['target']}
        if key not in meta:
            raise ValueError(f'config.{field}={config[field]!r}: its checkpoint has no {key!r}')
        out[name] = (int(meta[key]['max_len']), f'the {name} checkpoint in config.{field}')
    return out


def check_lengths(ev, ks, max_lens: dict[str, tuple[int, str]]) -> None:
    """ValueError with the arithmetic if a KV cache would not fit a model's max_len."""
    need = int(ev.prompt_len_max) + int(ev.max_new_tokens) + max(ks) + 1
    for name, (max_len, where) in max_lens.items():
        if need > max_len:
            room = max_len - int(ev.prompt_len_max) - max(ks) - 1
            raise ValueError(
                f'config.eval.prompt_len_max ({ev.prompt_len_max}) + config.eval.max_new_tokens '
                f'({ev.max_new_tokens}) + max(config.eval.ks) ({max(ks)}) + 1 = {need} positions, '
                f'above the {name} max_len={max_len} ({where}); e.g. '
                f'--config.eval.max_new_tokens={max(room, 0)} or a smaller prompt_len_max / ks'
            )


def run(config, workdir: str) -> dict:
    """The spec_eval mode: see the module docstring. Returns the spec_eval.json dict."""
    started = time.perf_counter()
    workdir = workdir_lib.resolve(workdir)
    ev = config.eval
    samplings, ks = _check_eval(ev)
    check_lengths(ev, ks, model_max_lens(config))
    with workdir_lib.opened(workdir, 'spec_eval', results=('results.json', 'spec_eval.json')):
        return _run(config, workdir, ev, samplings, ks, started)


def _run(config, workdir, ev, samplings, ks, started) -> dict:
    tok = build_tokenizer(config.data)
    mesh = make_mesh(config.mesh)
    rules, draft_rules = mesh_rules(config.mesh)
    target, draft, model_info = load_models(config, tok, mesh)
    prompts = make_prompts(
        config.data,
        tok,
        per_domain=int(ev.prompts_per_domain),
        min_len=int(ev.prompt_len_min),
        max_len=int(ev.prompt_len_max),
        seed=config.seed,
    )
    width, max_new = prompts.tokens.shape[1], int(ev.max_new_tokens)
    eos_id = tok.eos_id if ev.stop_at_eos else None
    t_graphdef, t_params = split(target)
    d_graphdef, d_params = split_draft(draft)
    ids = None if config.random_init else draft_vocab_ids(config.draft_workdir)

    cal = calibrate(
        target,
        draft,
        batch_size=int(ev.batch_size),
        ks=ks,
        context_len=width,
        capacity=width + max_new + max(ks) + 1,
        iters=int(ev.calibration_iters),
        repeats=int(ev.calibration_repeats),
        draft_vocab_ids=ids,
    )
    logging.info('calibration: c=%.3f v=%s', cal.c, {k: round(v, 2) for k, v in cal.v.items()})

    models = (target, draft, t_graphdef, d_graphdef, t_params, d_params, ids)
    points = dict(eos_id=eos_id, mesh=mesh, rules=rules, draft_rules=draft_rules)
    runs, buckets, optimal = _evaluate_all(config, ev, models, prompts, samplings, cal, points)
    result = {
        'mode': 'spec_eval',
        'config': config.to_dict(),
        'config_hash': workdir_lib.config_hash(config),
        'models': model_info,
        'tokenizer': tok.identity(),
        'prompts': _prompts_record(prompts, width, max_new, int(ev.batch_size)),
        'calibration': cal.to_dict(),
        'runs': runs,
        'buckets': buckets,
        'optimal_k': optimal,
        'flags': intervals.flags(cal.to_dict(), runs),
        'environment': measure.environment(),
        'memory': measure.process_memory(),
        'wall_s': time.perf_counter() - started,
    }
    if is_main_process():  # results and reports from process 0 only; earlier ones are kept
        workdir_lib.write_kept(
            workdir, 'spec_eval.json', json.dumps(jsonio.jsonable(result), indent=2)
        )
        headline_json = jsonio.jsonable(headline(result))  # NaN -> null, as before
        workdir_lib.write_results(workdir, 'spec_eval', headline_json, config)
        print(table_markdown(result), flush=True)
    return result


def _evaluate_all(config, ev, models, prompts, samplings, cal, points: dict):
    """(runs, buckets, optimal_k) over every sampling setting, in config order; `points` holds
    evaluate_sampling's eos_id, mesh, rules and draft_rules."""
    runs, buckets, optimal = [], {name: [] for name in BUCKET_KEYS}, {}
    for s_idx, (sampling, sampling_ks) in enumerate(samplings):
        seed = config.seed * 1000 + s_idx
        point_runs, point_buckets, optimal[sampling_label(sampling)] = evaluate_sampling(
            models, prompts, sampling, sampling_ks, cal, ev, seed=seed, **points
        )
        runs += point_runs
        for name, entries in point_buckets.items():
            buckets[name] += entries
    return runs, buckets, optimal


def _prompts_record(prompts, width: int, max_new: int, batch_size: int) -> dict:
    return {
        'count': len(prompts),
        'width': width,
        'max_new_tokens': max_new,
        'batch_size': batch_size,
        'per_domain': {d: int((prompts.domains == d).sum()) for d in sorted(set(prompts.domains))},
    }
