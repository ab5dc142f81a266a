"""The quickstart's tasks stage: JSON answers under a schema, per way of serving, and their cost.

config.count extraction tasks (specjax.evaluation.tasks: a stdlib function shown, one JSON
object asked for under tasks.SCHEMA) in the target's chat template, answered greedily (T = 0)
at batch 1 (serve's shapes, serve's k) by every method:
  target        the target alone under the schema's grammar: the reference answer
  target_free   the target alone, unconstrained (stops only)
  student       the distilled student (draft_distilled) alone under the grammar, restricted to
                its reduced vocabulary (specjax.sampling.task_vocab)
  student_free  the student alone, unconstrained
  spec_<draft>  the target with each draft serve measured (ce, distilled, feature, n-gram) at
                serve's k for it, under the grammar: verification is exact for the constrained
                target law, so at T = 0 its answers are the target's, token for token
                (`equal_to_target` records it; floating-point near-ties are the only way out).
Every row ends at the end-of-turn / eos token or where the grammar can only end. Each call is
timed config.repeats times (medians per answer), methods interleaved per task. Per method:
schema-valid rate (jsonschema), field agreement with the reference answer and with the truth,
finish reasons, mean new tokens, seconds per answer, speedup against the constrained target,
cost per valid answer; for speculative methods acceptance alpha (accepted / examined) and tau
(tokens per target call). The drafts trained on short rows get a larger max_len (their RoPE
blocks have no positional parameters) when a task's prompt and answer need it.

Entry point: `run(config, workdir, root)`; writes <workdir>/tasks.json.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import numpy as np

from specjax import jsonio
from specjax.checkpoint import load_model
from specjax.data import build_tokenizer
from specjax.evaluation import measure, tasks
from specjax.evaluation.pairs import draft_vocab_ids
from specjax.evaluation.route_stage import load_spec_draft
from specjax.evaluation.serving import alone_inputs, alone_tokens
from specjax.evaluation.spec_eval_sampling import dynamic_sampling
from specjax.models import Transformer, abstract_model, merge, split
from specjax.parallel import make_mesh
from specjax.sampling import (
    Grammar,
    NGramDraft,
    SamplingConfig,
    Stops,
    make_autoregressive_fn,
    make_speculative_fn,
)
from specjax.sampling import task as task_lib
from specjax.sampling.task import FinishReason
from specjax.sampling.task_vocab import restrict_task

STUDENT = 'draft_distilled'
END_OF_TURN = '<|im_end|>'  # SmolLM2's chat turns end with it (a stop token where it is one)


def check_config(cfg) -> None:
    """ValueError naming the field and value before anything loads."""
    for field, low in (('count', 1), ('max_new_tokens', 1), ('repeats', 1), ('max_chars', 40)):
        value = cfg.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f'config.tasks.{field} must be an int >= {low}, got {value!r}')


def stop_ids(tok) -> tuple[int, ...]:
    """The tokenizer's eos and, where it is one token, END_OF_TURN."""
    ids = [int(tok.eos_id)]
    end = tok.encode(END_OF_TURN)
    return tuple(dict.fromkeys(ids + (list(end) if len(end) == 1 else [])))


def chat_prompts(tok, task_list) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(tokens int32 [n, width] right-padded, lengths [n], rendered prompts): each task's
    question as the user turn of the tokenizer's chat template."""
    texts = [tok.apply_chat_template([{'role': 'user', 'content': t.question}]) for t in task_list]
    ids = [list(tok.encode(x)) for x in texts]
    table = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for r, row in enumerate(ids):
        table[r, : len(row)] = row
    return table, np.array([len(r) for r in ids], np.int32), texts


def fit_max_len(model, need: int):
    """`model`, or a Transformer with max_len `need` and the same parameters (RoPE: positions
    are computed, not stored); ValueError if its parameters would change."""
    if not isinstance(model, Transformer) or model.config.max_len >= need:
        return model
    graphdef, abstract = abstract_model(dataclasses.replace(model.config, max_len=need))
    params = split(model)[1]
    shapes = lambda tree: [
        (jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype))
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    if shapes(abstract) != shapes(params):
        raise ValueError(f"fit_max_len: a max_len of {need} changes the model's parameters")
    return merge(graphdef, params)


def build_calls(target, student, drafts, grammar, stops, *, max_new, sampling, common) -> dict:
    """{method: (sampler, params, ids of a reduced model served alone or None)} (module
    docstring). target: (graphdef, params); student: (graphdef, params, ids or None); drafts:
    {method: (graphdef or NGramDraft, params, ids or None, k)}; common: the samplers' mesh,
    rules and dynamic_sampling."""
    t_gd, t_params = target
    s_gd, s_params, s_ids = student
    v = _vocab(t_gd)
    args = dict(max_new_tokens=max_new, sampling=sampling, eos_id=None, **common)
    calls = {
        'target': (make_autoregressive_fn(t_gd, grammar=grammar, stops=stops, **args), [t_params],
                   None),
        'target_free': (make_autoregressive_fn(t_gd, stops=stops, **args), [t_params], None),
    }  # fmt: skip
    for name, g in (('student', grammar), ('student_free', None)):
        fn = make_autoregressive_fn(s_gd, **args)
        tables = task_lib.build(g, stops, v, 'tasks student')
        if s_ids is not None:
            tables = restrict_task(tables, s_ids, v)
        calls[name] = (fn.with_task(tables), [s_params], s_ids)
    for method, (d_gd, d_params, d_ids, k) in drafts.items():
        fn = make_speculative_fn(
            t_gd, d_gd, num_draft_tokens=int(k), grammar=grammar, stops=stops,
            draft_vocab_ids=None if d_ids is None else tuple(int(i) for i in d_ids), **args,
        )  # fmt: skip
        calls[method] = (fn, [t_params, d_params], None)
    return calls


def _vocab(graphdef) -> int:
    from specjax.sampling.common import config_of

    return config_of(graphdef).vocab_size


def timed_answers(calls, tokens, lengths, target_vocab: int, repeats: int, rng, compiled=None):
    """Each call on each prompt at batch 1, methods interleaved per prompt (order rotated),
    `repeats` times after an untimed warm-up -> ({method: seconds [n], the median per prompt},
    {method: dict(tokens [n, N] target ids, lengths, finish, accepted, examined, rounds)})."""
    names, n = list(calls), len(lengths)
    run = {m: (compiled or {}).get(m) or calls[m][0] for m in names}
    inputs = {m: alone_inputs(calls[m][2], target_vocab, tokens) for m in names}

    def call(m, i):
        return run[m](*calls[m][1], inputs[m][i : i + 1], lengths[i : i + 1], rng)

    seconds, outs = measure.per_prompt_times(call, names, n, repeats)
    answers = {}
    for m in names:
        o = outs[m]
        stat = lambda key, o=o: np.concatenate([np.asarray(x.stats.get(key, [0])) for x in o])
        answers[m] = dict(
            tokens=np.concatenate([alone_tokens(calls[m][2], x.tokens) for x in o]),
            lengths=np.concatenate([np.asarray(x.lengths) for x in o]),
            finish=np.concatenate([np.asarray(x.finish_reason) for x in o]),
            accepted=stat('row_accepted'), examined=stat('row_examined'),
            rounds=stat('row_rounds'),
        )  # fmt: skip
    return {m: np.median(t, axis=0) for m, t in seconds.items()}, answers


def answer_texts(tok, answers: dict, stops: tuple[int, ...]) -> list[str]:
    """Each row's tokens before its stop token, decoded."""
    out = []
    for row, n in zip(answers['tokens'], answers['lengths'], strict=True):
        ids = [int(t) for t in row[: int(n)]]
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        out.append(tok.decode(ids).strip())
    return out


def method_results(tok, task_list, seconds, answers, stops) -> dict:
    """{method: summary + per-task answers}, scored against the constrained target's answers."""
    texts = {m: answer_texts(tok, a, stops) for m, a in answers.items()}
    refs = [tasks.parse_answer(t)[0] for t in texts['target']]
    ref_s = float(np.mean(seconds['target']))
    ref_tokens = answers['target']
    out = {}
    for m, a in answers.items():
        scores = [
            tasks.score_answer(text, ref, t.truth)
            for text, ref, t in zip(texts[m], refs, task_list, strict=True)
        ]
        finish = [FinishReason(int(f)).name.lower() for f in a['finish']]
        s = tasks.summarize(scores, list(map(float, seconds[m])), list(map(int, a['lengths'])),
                            finish, ref_s)  # fmt: skip
        if m.startswith('spec_'):
            s['alpha'] = float(a['accepted'].sum() / max(a['examined'].sum(), 1))
            s['tau'] = float(a['lengths'].sum() / max(a['rounds'].sum(), 1))
            same = [
                np.array_equal(row[:n], ref[:n]) and n == rn
                for row, n, ref, rn in zip(a['tokens'], a['lengths'], ref_tokens['tokens'],
                                           ref_tokens['lengths'], strict=True)
            ]  # fmt: skip
            s['equal_to_target'] = float(np.mean(same))
        s['per_task'] = [
            dict(answer=text, format=sc['format'], agreement=sc['agreement'],
                 finish=f, new_tokens=int(n), seconds=float(sec))
            for text, sc, f, n, sec in zip(texts[m], scores, finish, a['lengths'], seconds[m])
        ]  # fmt: skip
        out[m] = s
    return out


def _models(config, root, serve, mesh, rules, need: int):
    """(target (gd, params), student (gd, params, ids), drafts {spec method: (gd, params, ids,
    k)}, target vocab size): serve's batch-1 speculative methods at their k."""
    target = load_model(os.path.join(root, 'target'), mesh=mesh, rules=rules)[0]
    student = fit_max_len(load_model(os.path.join(root, STUDENT), mesh=mesh, rules=rules)[0], need)
    b1 = min(r['batch_size'] for r in serve['rows'])
    drafts = {}
    for row in serve['rows']:
        if row['batch_size'] != b1 or not row['method'].startswith('spec_'):
            continue
        if row['method'] == 'spec_distilled':
            draft, ids = student, draft_vocab_ids(os.path.join(root, STUDENT))
        else:
            draft, ids = load_spec_draft(config, root, row['method'], mesh, rules)
            draft = fit_max_len(draft, need)
        d_gd, d_params = (draft, ()) if isinstance(draft, NGramDraft) else split(draft)
        drafts[row['method']] = (d_gd, d_params, ids, row['k'])
    s_ids = draft_vocab_ids(os.path.join(root, STUDENT))
    return split(target), (*split(student), s_ids), drafts, target.config.vocab_size


def corpus_tasks(config) -> list:
    """config.count tasks from the embedded corpus's validation split (tasks.make_tasks)."""
    from specjax.data import stdlib_source

    docs = stdlib_source.assign_splits(stdlib_source.code_documents())['validation']
    pairs = [(d.source, d.text) for d in docs]
    return tasks.make_tasks(pairs, int(config.count), int(config.max_chars), int(config.seed))


def run(config, workdir: str, root: str) -> dict:
    started = time.perf_counter()
    check_config(config)
    mesh, rules = make_mesh(config.mesh), config.mesh.rules
    with open(os.path.join(root, 'serve', 'serve.json')) as f:
        serve = json.load(f)
    tok = build_tokenizer(config.data)
    task_list = corpus_tasks(config)
    tokens, lengths, texts = chat_prompts(tok, task_list)
    n = int(config.max_new_tokens)
    need = tokens.shape[1] + n + max([r.get('k') or 0 for r in serve['rows']] + [0]) + 2
    target, student, drafts, vocab = _models(config, root, serve, mesh, rules, need)
    grammar = Grammar.from_json_schema(tok, tasks.SCHEMA)
    ends = stop_ids(tok)
    stops = Stops(tok, token_ids=ends)
    sampling = SamplingConfig(temperature=0.0)
    common = dict(mesh=mesh, rules=rules, dynamic_sampling=dynamic_sampling(sampling, config.eval))
    calls = build_calls(target, student, drafts, grammar, stops, max_new=n, sampling=sampling,
                        common=common)  # fmt: skip
    rng = jax.random.key(config.seed)
    jobs = [
        (fn, params, alone_inputs(ids, vocab, tokens[:1]), lengths[:1], rng)
        for fn, params, ids in calls.values()
    ]
    compiled = dict(zip(calls, measure.compile_samplers(jobs), strict=True))
    seconds, answers = timed_answers(calls, tokens, lengths, vocab, int(config.repeats), rng,
                                     compiled)  # fmt: skip
    methods = method_results(tok, task_list, seconds, answers, ends)
    result = dict(
        methods=methods,
        reference='target',
        schema=tasks.SCHEMA,
        grammar={
            'states': grammar.num_states,
            'transitions': grammar.num_transitions,
            'bytes': grammar.nbytes,
        },  # fmt: skip
        student=STUDENT,
        ks={m: d[3] for m, d in drafts.items()},
        sampling=sampling.to_dict(),
        max_new_tokens=n,
        repeats=int(config.repeats),
        stop_ids=list(ends),
        tasks=[
            dict(source=t.source, truth=t.truth, prompt_tokens=int(ln), digest=tasks.digest(x))
            for t, ln, x in zip(task_list, lengths, texts, strict=True)
        ],
        config={k: config[k] for k in ('count', 'max_chars', 'max_new_tokens', 'repeats')},
        compile_s={m: c.compile_s for m, c in compiled.items()},
        environment=measure.environment(),
        seconds=time.perf_counter() - started,
    )
    os.makedirs(workdir, exist_ok=True)
    jsonio.write_json(os.path.join(workdir, 'tasks.json'), result)
    for m, s in methods.items():
        logging.info('tasks: %s valid %.2f agreement %s, %.3g s/answer', m, s['valid_rate'],
                     s['agreement'], s['seconds_per_answer'])  # fmt: skip
    return result
