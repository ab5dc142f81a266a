"""The SmolLM2 preset's feature draft: EAGLE-3's shape trained on the teacher cache's rows.

Stage `draft_feature` (specjax.quickstart.smollm2.stages) runs the `feature_draft` mode
(specjax.distill.feature_mode: checkpoints, bit-identical resume, the workdir lock, SIGTERM ->
exit 42) with SmolLM2 (<root>/target) as the frozen target and, as its rows, row sets of
<root>/teacher_cache/teacher.npz chosen by config.draft_feature.rows (ROW_SETS): 'teacher' (the
key's meaning when absent) is the distilled draft's rows, SmolLM2's own continuations of corpus
prompts (`train_*`, DistillSpec's teacher-generated data); 'corpus' the cache's packed corpus
rows (`corpus_*`, whose first tokens were those prompts); 'teacher+corpus' (the preset's
setting) both, continuations first. They are drawn in RowOrder (specjax.distill.reduced_task,
the distilled draft's seed; its order for 'teacher') and fed to the mode as its 'dataset'
source. Every row's targets are SmolLM2's distribution there, so a corpus row costs one target
forward where a continuation cost a generation. With config.draft_feature.feature.cache (the
preset's setting), SmolLM2's features of the chosen layers and its log-probs over the N ids are
computed once for all those rows and kept in bfloat16 in <wd>/feature_cache
(specjax.distill.feature_cache: resumed if interrupted, reused by a rerun; its size and build
time in results.json), and each step reads its rows' from there; without it the target
recomputes them in every step (it fits beside the draft). The draft proposes the cache's N ids
(<root>/teacher_cache/vocab.json), as the other two drafts do.
Evaluation: the TTT loss and alpha per unrolled step on the cache's held-out corpus rows
(`eval_*`); spec_eval (stage spec_feature) measures acceptance and speed.
"""

from __future__ import annotations

import os

import numpy as np

CACHE_DIR = 'teacher_cache'
FEATURE_CACHE_DIR = 'feature_cache'  # in the stage's workdir (config.feature.cache)
# config.draft_feature.rows -> the teacher cache's row sets trained on, in this order
ROW_SETS = {'teacher': ('train',), 'corpus': ('corpus',), 'teacher+corpus': ('train', 'corpus')}


def training_arrays(arrays: dict, rows: str) -> dict:
    """The teacher cache's `arrays` with `train_*` holding the rows of ROW_SETS[rows] (tokens,
    positions, segment_ids concatenated in that order; the arrays as they are for 'teacher')."""
    from specjax.distill.reduced_train import BATCH3

    if rows == 'teacher':
        return arrays
    out = {k: v for k, v in arrays.items() if not k.startswith('train_')}
    for x in BATCH3:
        out[f'train_{x}'] = np.concatenate([arrays[f'{s}_{x}'] for s in ROW_SETS[rows]])
    return out


def cache_rows(arrays: dict, prefix: str, rows, features=None) -> dict:
    """A host batch (tokens, positions, segment_ids, domain_ids int32 [B, T]) of cached rows,
    with their features and target_logp (bfloat16) from `features`, a FeatureCache of the
    `prefix` rows, when given."""
    from specjax.distill import feature_cache
    from specjax.distill.reduced_train import BATCH3

    out = {x: np.asarray(arrays[f'{prefix}_{x}'][rows], np.int32) for x in BATCH3}
    out['domain_ids'] = np.zeros_like(out['tokens'])  # the cache keeps no domains
    if features is not None:
        out.update(feature_cache.rows(features, rows))
    return out


def cache_data(
    cache_dir: str, tok, batch: int, seed: int, eval_batches: int, features=None, rows='teacher'
):
    """The feature mode's RunData over the teacher cache: the rows of ROW_SETS[rows] in
    RowOrder(seed) (with their cached features from `features`, a FeatureCache of those rows,
    when given), the first `eval_batches` batches of its held-out rows; the corpus identity
    (checked on resume) is a fingerprint of those arrays."""
    from specjax.distill.reduced_task import RowOrder, fingerprint
    from specjax.distill.reduced_train import load_cache
    from specjax.train.runs import RunData

    arrays = training_arrays(load_cache(cache_dir)[1], rows)
    m = len(arrays['train_tokens'])
    order = RowOrder(lambda rows: cache_rows(arrays, 'train', rows, features), m, batch, seed)
    n_eval = len(arrays['eval_tokens'])
    starts = range(0, n_eval, batch)[: max(int(eval_batches), 1)]
    evals = [cache_rows(arrays, 'eval', np.arange(a, min(a + batch, n_eval))) for a in starts]
    return RunData(
        train=order,
        eval_batches=evals,
        tokenizer=tok.identity(),
        corpus={'teacher_cache': fingerprint(arrays, ('train', 'eval'))},
        vocab_size=tok.vocab_size,
        domains=('all',),
        eos_id=tok.eos_id,
    )


def check_config(cfg, seq_len: int) -> None:
    """ValueError naming the field: known row sets (cfg.rows), rows as long as the cache's, the
    'dataset' source (the feature cache, config.draft_feature.feature.cache, is of those rows)."""
    rows = cfg.get('rows', 'teacher')
    if rows not in ROW_SETS:
        raise ValueError(
            f'config.draft_feature.rows={rows!r} must be one of {sorted(ROW_SETS)} (the '
            "teacher cache's row sets trained on)"
        )
    if int(cfg.data.seq_len) != seq_len:
        raise ValueError(
            f'config.draft_feature.data.seq_len={cfg.data.seq_len} must equal the cached rows '
            f'({seq_len} tokens, config.teacher_cache.data.seq_len)'
        )
    if cfg.distill.source != 'dataset':
        cached = ' (and config.draft_feature.feature.cache=True caches their features)'
        raise ValueError(
            f"config.draft_feature.distill.source={cfg.distill.source!r} must be 'dataset': "
            "the rows are the teacher cache's continuations"
            + (cached if cfg.feature.get('cache') else '')
        )


def take_rows(cfg) -> str:
    """cfg.rows ('teacher' when absent), taken out of `cfg` (locked or not): the preset's key,
    which the feature_draft mode's config does not have."""
    rows = cfg.get('rows', 'teacher')
    if 'rows' in cfg:
        with cfg.unlocked():
            del cfg['rows']
    return rows


def run_draft_feature(cfg, wd, root):
    """The stage: SmolLM2's tokenizer from <root>/target, then train_on_cache on the row sets
    of cfg.rows (the preset's key, not the mode's: taken out of cfg)."""
    from specjax import data as data_lib

    rows = take_rows(cfg)
    cfg.data.tokenizer = 'huggingface'
    cfg.data.tokenizer_path = os.path.join(root, 'target')
    train_on_cache(cfg, wd, root, data_lib.build_tokenizer(cfg.data), rows=rows)


def train_on_cache(cfg, wd, root, tok, on_step=None, rows='teacher') -> dict:
    """The feature_draft mode of `cfg` (configs/feature_draft.py's sections) into `wd`, with
    <root>/target as the target, <root>/teacher_cache's N ids as the vocabulary and its rows of
    ROW_SETS[rows] as the data -> the mode's results (<wd>/results.json unless preempted; a
    rerun resumes; on_step: run_loop's).
    cfg.feature.cache: SmolLM2 is loaded once, its outputs on every train row are cached in
    <wd>/feature_cache (built, resumed or reused) and the steps read them from there."""
    from specjax import workdir as workdir_lib
    from specjax.distill import feature_cache, feature_mode
    from specjax.distill.reduced_train import BATCH3, VOCAB_FILE, load_cache

    cfg.distill.teacher_workdir = os.path.join(root, 'target')
    cache_dir = os.path.join(root, CACHE_DIR)
    cfg.feature.vocab_file = os.path.join(cache_dir, VOCAB_FILE)
    batch = int(cfg.train.batch_size)
    args = (cache_dir, tok, batch, int(cfg.seed), int(cfg.train.eval_batches))
    if not cfg.feature.cache:
        data = cache_data(*args, rows=rows)
        return feature_mode.run_feature_draft(cfg, wd, data=data, on_step=on_step)
    draft_cfg, ids = feature_mode.prepare(cfg, data_config=False)  # before SmolLM2 loads
    with workdir_lib.opened(wd, feature_mode.MODE) as wd:  # the mode re-enters the lock
        teacher, mesh, rules = feature_mode.load_target(cfg)
        arrays = training_arrays(load_cache(cache_dir)[1], rows)
        train = {x: arrays[f'train_{x}'] for x in BATCH3}
        features = feature_cache.build_or_load(
            teacher, train, draft_cfg.feature_layers, ids, batch,
            os.path.join(wd, FEATURE_CACHE_DIR), mesh=mesh, rules=rules,
        )  # fmt: skip
        data = cache_data(*args, features=features, rows=rows)
        return feature_mode.run_feature_draft(
            cfg, wd, data=data, on_step=on_step, teacher=teacher, feature_cache=features
        )
