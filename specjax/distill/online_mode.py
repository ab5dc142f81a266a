"""Mode `online_distill` (issue 41): a draft that follows the traffic, under a domain shift.

A stream of requests (specjax.distill.online_stream: the first half from one domain of the
corpus, the rest from the other) is served in rounds of config.stream.batch_size requests by the
speculative sampler (the target verifies, so every served request follows the target's law
whatever the draft), three times over with the same prompts and the same key per round, by three
drafts taking turns: `online` (starts as the trained draft and is updated from what it served),
`frozen` (that draft unchanged) and `retrained` (a draft trained offline on the second domain,
the upper bound). After each online round the served rows are re-scored (online_update), the
positions the draft got wrong and a sample of the rest enter a bounded buffer (online_buffer);
every config.online.update_every requests config.online.steps distillation steps on the buffer
update the draft, which serves from the next round on. Per window of requests the arms' alpha,
tau, tokens/s and the update's CPU cost are reported (online_report).

Writes <workdir>/online.json (rows and summary), <workdir>/results.json (the summary, stage
times, buffer size) and <workdir>/plots/online_alpha.png. The online draft's state (parameters,
AdamW state), the buffer and the stream position are checkpointed in <workdir>/checkpoints after
every config.online.checkpoint_every updates; a rerun resumes there and computes what an
uninterrupted run would have (timings aside); `load_model(<workdir>)` reads the online draft
(its metadata's model_config is the draft's). A finished workdir is returned as it is.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import workdir as workdir_lib
from specjax.checkpoint import Checkpoints, load_model
from specjax.data import build_tokenizer
from specjax.distill import online_report as report
from specjax.distill.online_buffer import OnlineBuffer, select
from specjax.distill.online_config import MODE, check_sections, optimizer_config, validate
from specjax.distill.online_prereqs import check_target_given, prepare, target_vocab
from specjax.distill.online_stream import make_stream
from specjax.distill.online_update import (
    STEP_KEYS,
    jit_online_steps,
    loss_settings,
    rescore_program,
    served_entries,
    update_batches,
)
from specjax.jsonio import to_json
from specjax.models import split
from specjax.parallel import batch_sharding, make_mesh
from specjax.parallel.mesh import mesh_rules
from specjax.sampling import make_speculative_fn
from specjax.sampling.common import check_same_tokenizer
from specjax.train.optimizer import make_optimizer
from specjax.train.state import TrainState, plan_train_state

ONLINE_FILE = 'online.json'
_STATS = ('row_emitted', 'row_rounds', 'row_accepted', 'row_examined')


def run(config, workdir: str) -> dict:
    """The mode (specjax.main calls it through specjax.quickstart.online.run, which imports a
    config.target.source first): checks, prerequisites, the stream, the report."""
    check_sections(config)
    check_target_given(config)
    settings = validate(config, target_vocab(config))
    if jax.process_count() > 1:
        raise ValueError(f'{MODE} runs in one process; got {jax.process_count()}')
    with workdir_lib.opened(workdir, MODE, (workdir_lib.RESULTS_FILE, ONLINE_FILE)) as workdir:
        done = _finished(workdir, config)
        if done is not None:
            return done
        if config.compilation_cache:
            jax.config.update(
                'jax_compilation_cache_dir', os.path.expanduser(config.compilation_cache)
            )
            jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
        t0 = time.perf_counter()
        tok = build_tokenizer(config.data)
        pre = prepare(config, workdir, tok)
        if pre.preempted:
            return {'preempted': True, 'stages_trained': list(pre.trained)}
        online = OnlineRun(config, settings, workdir, tok, pre)
        online.seconds['prerequisites'] = time.perf_counter() - t0
        return online.run()


def _finished(workdir: str, config):
    """results.json of a finished run with this config (None when there is none); a finished
    run of other settings is refused naming the fields."""
    file = os.path.join(workdir, workdir_lib.RESULTS_FILE)
    if not os.path.exists(file):
        return None
    with open(file) as f:
        results = json.load(f)
    workdir_lib.check_config_change(results['config'], config, allow=False, where=file)
    print(f'{MODE}: {workdir} holds a finished run; results: {file}', flush=True)
    return results


class OnlineRun:
    """The stream served by the three arms, with the online draft's updates and checkpoints."""

    def __init__(self, config, settings, workdir, tok, pre):
        self.config, self.settings, self.workdir = config, settings, workdir
        self.stream_cfg, self.o = config.stream, config.online
        self._per_row = int(config.stream.max_new_tokens)  # the most entries of one request
        self.seed = int(config.seed)
        self.seconds = {}
        self.mesh = make_mesh(config.mesh)
        rules, draft_rules = mesh_rules(config.mesh)
        target, meta = load_model(pre.target, mesh=self.mesh, rules=rules)
        self._check_tokenizer(meta, tok, pre.target)
        self.tgd, self.tparams = split(target)
        self.dgd, self.params = {}, {}
        for arm, path in (('frozen', pre.draft), ('retrained', pre.retrained)):
            draft, dmeta = load_model(path, mesh=self.mesh, rules=draft_rules)
            self._check_tokenizer(dmeta, tok, path)
            self.dgd[arm], self.params[arm] = split(draft)
            if arm == 'frozen':
                self.draft_cfg = draft.config
        self.dgd['online'] = self.dgd['frozen']
        self.paths = {'target': pre.target, 'draft': pre.draft, 'retrained': pre.retrained}
        self.trained = pre.trained
        self.stream = make_stream(config.data, tok, config.stream, self.seed)
        self.eos = tok.eos_id if config.stream.stop_at_eos else None
        self.identity = {
            'model_config': self.draft_cfg.to_dict(),
            'target_config': target.config.to_dict(),
            'tokenizer': tok.identity(),
        }
        self._build(draft_rules, rules)

    @staticmethod
    def _check_tokenizer(meta, tok, path):
        try:
            check_same_tokenizer(meta, to_json(tok.identity()))
        except ValueError as e:
            raise ValueError(
                f'{path} was trained with another tokenizer than config.data: {e}'
            ) from None

    def _build(self, draft_rules, rules):
        s = self.stream_cfg
        common = dict(
            num_draft_tokens=int(s.k), max_new_tokens=int(s.max_new_tokens),
            sampling=self.settings.sampling, eos_id=self.eos, mesh=self.mesh, rules=rules,
            draft_rules=draft_rules,
        )  # fmt: skip
        # (arm, learning): the online arm's learning rounds also return the target's log-probs
        self.samplers = {
            (a, learn): make_speculative_fn(
                self.tgd, self.dgd[a], **common, target_logprobs=learn
            )  # fmt: skip
            for a in report.ARMS
            for learn in ((False, True) if a == 'online' else (False,))
        }
        self.rescore = {  # (arm, learning): measuring alpha, or the draft's side of learning
            (a, learn): rescore_program(
                self.tgd, self.dgd[a], self.settings.sampling, self.mesh, learn, served=learn
            )
            for a, learn in self.samplers
        }
        tx = make_optimizer(optimizer_config(self.o, self.settings.total_steps))
        self.plan = plan_train_state(self.draft_cfg, tx, self.seed, self.mesh, draft_rules)
        self.step_fn, self.steps_sharding = jit_online_steps(
            self.dgd['online'], tx, loss_settings(self.o), self.plan.shardings,
            batch_sharding(self.mesh, rules), self.mesh,
        )  # fmt: skip
        init = jax.jit(
            lambda p: TrainState(
                step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p),
                rng=jax.random.PRNGKey(self.seed),
            ),
            out_shardings=self.plan.shardings,
        )  # fmt: skip
        self.fresh_state = lambda: init(self.params['frozen'])
        vocab = self.tgd_vocab = target_vocab_of(self.tgd)
        self.empty_buffer = lambda: OnlineBuffer.empty(
            int(self.o.buffer_size), self.settings.width, vocab
        )
        buffer_abstract = self.empty_buffer().arrays  # numpy leaves: restored as numpy
        self.abstract = dict(_fields(self.plan.abstract), buffer=buffer_abstract)

    # ---------------------------------------------------------------- checkpoints

    def _resume(self, ckpts: Checkpoints):
        """(state, buffer, progress) of the newest intact checkpoint, or fresh ones."""
        if ckpts.latest_step() is None:
            progress = {'round': 0, 'updates': 0, 'rows': [], 'windows': report.empty_windows()}
            return self.fresh_state(), self.empty_buffer(), progress

        def read(step):
            ckpts.check_identity(self.identity, step)
            saved = ckpts.metadata(step).get('config')
            workdir_lib.check_config_change(
                saved, self.config, allow=False, where=f'{ckpts.directory} (step {step})'
            )
            return ckpts.restore(self.abstract, step, finite=lambda s: s['params'])

        step, (state, progress, _) = ckpts.newest_readable(read)
        if ckpts.skipped:
            ckpts.move_aside([s for s, _ in ckpts.skipped])
        buffer = OnlineBuffer({k: np.asarray(v) for k, v in state.pop('buffer').items()})
        print(f'{MODE}: resumed after request {step} from {ckpts.directory}', flush=True)
        return TrainState(**state), buffer, dict(progress)

    def _save(self, ckpts, requests: int, state, buffer, progress) -> None:
        t0 = time.perf_counter()
        ckpts.save(
            requests,
            dict(_fields(state), buffer=buffer.state()),
            data_state=progress,
            metadata=dict(self.identity, config=self.config, mode=MODE),
            finite=state.params,
        )
        self.seconds['checkpoints'] = (
            self.seconds.get('checkpoints', 0.0) + time.perf_counter() - t0
        )

    # ---------------------------------------------------------------- the stream

    def _warm_up(self, state) -> None:
        """Compiles every program on the first round's shapes before anything is timed."""
        t0 = time.perf_counter()
        prompts, lengths = self.stream.batch(0, int(self.stream_cfg.batch_size))
        key = jax.random.key(self.seed ^ 0x5EED)
        for arm, learn in self.samplers:
            params = state.params if arm == 'online' else self.params[arm]
            out = self.samplers[arm, learn](self.tparams, params, prompts, lengths, key)
            served = (out.target_logprobs,) if learn else ()
            jax.block_until_ready(self.rescore[arm, learn](
                self.tparams, params, prompts, lengths, out.tokens, out.lengths, *served
            ))  # fmt: skip
        n, width, e = int(self.o.batch_size), self.settings.width, self._per_row
        s = int(self.o.steps)
        dummy = self._place(
            {'tokens': np.zeros((s, n, width), np.int32), 'length': np.ones((s, n), np.int32),
             'at': np.zeros((s, n, e), np.int32), 'mask': np.zeros((s, n, e), bool),
             'teacher': np.zeros((s, n, e, self.tgd_vocab), np.float32)}
        )  # fmt: skip
        copy = jax.tree.map(jnp.copy, state)
        jax.block_until_ready(self.step_fn(copy, *dummy))
        self.seconds['compile'] = time.perf_counter() - t0

    def _place(self, batch):
        return [jax.device_put(batch[k], self.steps_sharding) for k in STEP_KEYS]

    def _serve(self, arm, learn, params, prompts, lengths, key):
        w0, c0 = time.perf_counter(), time.process_time()
        out = self.samplers[arm, learn](self.tparams, params, prompts, lengths, key)
        jax.block_until_ready((out.tokens, out.lengths, out.stats))
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        return out, jax.device_get({k: out.stats[k] for k in _STATS}), wall, cpu

    def _learn(self, acc, r, params, prompts, lengths, out, buffer):
        """Scores the online arm's served rows with the draft (the target's log-probs came
        with them) and adds entries -> (alpha, mask)."""
        w0, c0 = time.perf_counter(), time.process_time()
        seq, mask, alpha, _ = jax.device_get(self.rescore['online', True](
            self.tparams, params, prompts, lengths, out.tokens, out.lengths, out.target_logprobs
        ))  # fmt: skip
        rows, cols, wrong = select(
            alpha, mask, wrong_below=float(self.o.wrong_below),
            right_fraction=float(self.o.right_fraction), seed=self.seed, round_=r,
        )  # fmt: skip
        b = int(self.stream_cfg.batch_size)
        logp = served_entries(out.target_logprobs, lengths, rows, cols)
        buffer.add(seq, rows, cols, logp, wrong, r * b + rows)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        acc.update(
            update_cpu_s=acc['update_cpu_s'] + cpu, update_wall_s=acc['update_wall_s'] + wall,
            rescore_cpu_s=acc['rescore_cpu_s'] + cpu, added=acc['added'] + len(rows),
            added_wrong=acc['added_wrong'] + int(np.sum(wrong)),
        )  # fmt: skip
        return alpha, mask

    def _update(self, acc, state, buffer, update: int):
        """config.online.steps distillation steps on the buffer (one program) -> the new state."""
        w0, c0 = time.perf_counter(), time.process_time()
        n, e, steps = int(self.o.batch_size), self._per_row, int(self.o.steps)
        batch = update_batches(buffer, steps, n, per_row=e, seed=self.seed, update=update)
        state, _ = self.step_fn(state, *self._place(batch))
        jax.block_until_ready(state)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        acc.update(
            update_cpu_s=acc['update_cpu_s'] + cpu, update_wall_s=acc['update_wall_s'] + wall,
            step_cpu_s=acc['step_cpu_s'] + cpu, updates=acc['updates'] + 1,
            steps=acc['steps'] + steps,
        )  # fmt: skip
        return state

    def run(self) -> dict:
        with Checkpoints(self.workdir, keep=2, async_save=False) as ckpts:
            state, buffer, progress = self._resume(ckpts)
            self._warm_up(state)
            t0 = time.perf_counter()
            state, buffer, progress = self._stream(ckpts, state, buffer, progress)
            self.seconds['stream'] = time.perf_counter() - t0
        return self._finish(progress, buffer)

    def _stream(self, ckpts, state, buffer, progress):
        s, b = self.stream_cfg, int(self.stream_cfg.batch_size)
        base = jax.random.key(self.seed)
        windows = progress['windows']
        for r in range(int(progress['round']), self.settings.rounds):
            prompts, lengths = self.stream.batch(r * b, b)
            key = jax.random.fold_in(base, r)
            for j in range(len(report.ARMS)):  # turns rotate: drift hits every arm alike
                arm = report.ARMS[(r + j) % len(report.ARMS)]
                params = state.params if arm == 'online' else self.params[arm]
                learn = arm == 'online' and r % int(self.o.learn_every) == 0
                out, stats, wall, cpu = self._serve(arm, learn, params, prompts, lengths, key)
                if learn:
                    alpha, mask = self._learn(
                        windows[arm], r, params, prompts, lengths, out, buffer
                    )
                else:  # measurement only: not part of any arm's cost
                    _, mask, alpha, _ = jax.device_get(self.rescore[arm, False](
                        self.tparams, params, prompts, lengths, out.tokens, out.lengths
                    ))  # fmt: skip
                report.add_serving(windows[arm], out, stats, alpha, mask, wall, cpu)
            done = (r + 1) * b
            updated = done % int(self.o.update_every) == 0 and buffer.filled > 0
            if updated:
                state = self._update(windows['online'], state, buffer, int(progress['updates']))
                progress['updates'] += 1
            if done % int(s.window) == 0:
                self._close_window(progress, windows, done, buffer)
                windows = progress['windows']
            progress['round'] = r + 1
            last = r + 1 == self.settings.rounds
            if last or (updated and progress['updates'] % int(self.o.checkpoint_every) == 0):
                if done not in ckpts.all_steps():
                    self._save(ckpts, done, state, buffer, progress)
        return state, buffer, progress

    def _close_window(self, progress, windows, done, buffer) -> None:
        w = done // int(self.stream_cfg.window) - 1
        domain = str(self.stream.domains[done - 1])
        rows = [
            report.window_row(
                w, arm, domain, windows[arm], buffer.filled if arm == 'online' else None
            )
            for arm in report.ARMS
        ]
        progress['rows'] = list(progress['rows']) + rows
        progress['windows'] = report.empty_windows()
        line = '  '.join(f'{r["arm"]} {r["alpha"] or float("nan"):.3f}' for r in rows)
        cost = rows[0]['update_cpu_s'] / max(rows[0]['serve_cpu_s'] or 0.0, 1e-12)
        print(f'window {w} ({domain}): alpha {line}  update/serve CPU {cost:.2f}', flush=True)

    # ---------------------------------------------------------------- results

    def _finish(self, progress, buffer) -> dict:
        rows = progress['rows']
        domains = tuple(self.stream_cfg.domains)
        summary = report.summarize(rows, domains)
        plot = report.write_plot(self.workdir, rows, domains, int(self.stream_cfg.window))
        online = {'rows': rows, 'summary': summary, 'arms': list(report.ARMS)}
        workdir_lib.write_results(self.workdir, MODE, online, self.config, name=ONLINE_FILE)
        results = {
            'summary': summary,
            'workdirs': self.paths,
            'stages_trained': list(self.trained),
            'buffer': dict(buffer.counts(), capacity=buffer.capacity, bytes=buffer.nbytes),
            'updates': int(progress['updates']),
            'seconds': self.seconds,
            'online_json': os.path.join(self.workdir, ONLINE_FILE),
            'plot': plot,
            'preempted': False,
        }
        path = workdir_lib.write_results(self.workdir, MODE, results, self.config)
        a = summary['alpha']
        print(
            f'alpha on {domains[1]}: online {a["online"][domains[1]]:.3f} frozen '
            f'{a["frozen"][domains[1]]:.3f} retrained {a["retrained"][domains[1]]:.3f}; recovered '
            f'(>= 50% of the gap) from window {summary["recovered_from"]}; update CPU / serving '
            f'CPU {summary["update_fraction"]:.3f}\nresults: {path}\nplot: {plot}',
            flush=True,
        )
        return results


def _fields(state: TrainState) -> dict:
    """A TrainState as the flat dict the checkpoint holds (with 'buffer' beside): its params
    under 'params', so load_model(<workdir>) returns the online draft."""
    return {
        'step': state.step,
        'params': state.params,
        'opt_state': state.opt_state,
        'rng': state.rng,
    }


def target_vocab_of(graphdef) -> int:
    from specjax.sampling.common import config_of

    return int(config_of(graphdef).vocab_size)
