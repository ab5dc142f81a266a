"""Runs the quickstart's stages in order: in this process, or training stages side by side.

With config.parallel_stages = 1 every stage runs here, one after the other. With more workers,
stages marked `concurrent` (training: the two drafts and co-training each need only the target)
run in child processes, up to that many at once, each logging to <stage>/log.txt; every other
stage (timing measurements: spec_eval, serving) still runs alone, so its latencies are measured
on an otherwise idle machine. 0 means: 2 workers for a single-process CPU run on 2+ cores (a
small draft's training step uses about one core), else 1. Each stage's wall and process CPU
seconds, and the stages it ran beside, go to <workdir>/quickstart.json.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from multiprocessing import connection

from specjax import jsonio

RUN_FILE = 'quickstart.json'
LOG_FILE = 'log.txt'


def workers(config) -> int:
    """config.parallel_stages resolved: 0 = auto (see the module docstring)."""
    n = config.get('parallel_stages', 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f'config.parallel_stages must be an int >= 0 (0 = auto), got {n!r}')
    if n:
        return n
    import jax

    single_cpu = jax.process_count() == 1 and jax.default_backend() == 'cpu'
    return 2 if single_cpu and (os.cpu_count() or 1) >= 2 else 1


def read_run(workdir) -> dict:
    """<workdir>/quickstart.json, or {} before the first stage has finished."""
    path = os.path.join(workdir, RUN_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def record_run(workdir, name, seconds, cpu_seconds, beside=(), total=None) -> None:
    """Adds wall and process CPU seconds to a stage's totals (CPU seconds are what a shared
    machine inflates least; every attempt counts, preempted ones included), the stages it ran
    beside, and `total`: the wall seconds of every invocation so far (None: leave it)."""
    record = read_run(workdir)
    if name:
        for key, value in (('stage_seconds', seconds), ('stage_cpu_seconds', cpu_seconds)):
            times = record.setdefault(key, {})
            times[name] = times.get(name, 0.0) + value
        overlaps = record.setdefault('stage_beside', {})
        overlaps[name] = sorted(set(overlaps.get(name, [])) | set(beside))
    if total is not None:
        record['total_seconds'] = total
    record['load_average'] = os.getloadavg()
    record['cpu_count'] = os.cpu_count()
    jsonio.write_json(os.path.join(workdir, RUN_FILE), record)


def committed_steps(workdir) -> list[int]:
    """The checkpoint steps orbax has committed in <workdir>/checkpoints, ascending (a step's
    folder is renamed to its bare number only once written; its metadata file is checked too)."""
    from specjax.checkpoint import CHECKPOINT_DIR

    root = os.path.join(workdir, CHECKPOINT_DIR)
    try:
        names = os.listdir(root)
    except OSError:
        return []
    done = (n for n in names if n.isdigit())
    return sorted(int(n) for n in done if os.path.isfile(os.path.join(root, n, _STEP_METADATA)))


_STEP_METADATA = '_CHECKPOINT_METADATA'  # written by orbax into every committed step


def saved_text(wd) -> str:
    """What a stopped stage left in its workdir `wd`, and what a rerun does with it."""
    steps = committed_steps(wd)
    if steps:
        return (
            f'checkpoint step {steps[-1]} is committed in {wd}: rerun the same command to resume '
            'from it'
        )
    return (
        f'nothing of it was saved (no committed checkpoint in {wd}): rerun the same command to '
        'resume; this stage starts over'
    )


def enable_cache(path: str) -> None:
    """Turns on JAX's persistent compilation cache in `path` ('' = off)."""
    if path:
        import jax

        jax.config.update('jax_compilation_cache_dir', os.path.expanduser(path))
        jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


class Progress:
    """Stage-by-stage progress with an ETA: the estimates rescaled by the pace so far; stages
    that run side by side count as their estimate / workers."""

    def __init__(self, stages, estimates, n_workers: int = 1):
        self.todo = [s.name for s in stages]
        share = {s.name: 1.0 / n_workers if s.concurrent and n_workers > 1 else 1.0 for s in stages}
        self.estimates = {s.name: float(estimates.get(s.name, 60.0)) for s in stages}
        self.weighted = {n: self.estimates[n] * share[n] for n in self.todo}
        self.started = time.perf_counter()
        self.spent_est = 0.0
        self.finished: set[str] = set()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def begin(self, name: str, beside=()) -> None:
        elapsed = self.elapsed()
        pace = elapsed / self.spent_est if self.spent_est else 1.0
        remaining = pace * sum(w for n, w in self.weighted.items() if n not in self.finished)
        note = f' (beside {", ".join(beside)})' if beside else ''
        print(
            f'[quickstart] stage {self.todo.index(name) + 1}/{len(self.todo)} {name}{note}: '
            f'~{pace * self.estimates[name]:.0f} s; elapsed {elapsed:.0f} s, ETA {remaining:.0f} s',
            flush=True,
        )

    def end(self, name: str, seconds: float, log: str = '') -> None:
        self.finished.add(name)
        self.spent_est += self.weighted[name]
        where = f' (log: {log})' if log else ''
        print(f'[quickstart] {name} done in {seconds:.0f} s{where}', flush=True)


def run_here(stage, cfg, wd, workdir) -> tuple[float, float]:
    """Runs one stage in this process -> (wall seconds, process CPU seconds)."""
    t0, c0 = time.perf_counter(), time.process_time()
    stage.run(cfg, wd, workdir)
    return time.perf_counter() - t0, time.process_time() - c0


def _child(stage, cfg, wd, workdir, log_path, cache_dir, conn) -> None:
    """A child process: logs to log_path, runs `stage` with its config `cfg`, sends
    (seconds, cpu) or the error. It receives what it runs; it imports no pipeline."""
    with open(log_path, 'a') as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    from absl import logging

    from specjax import host_malloc
    from specjax.train.metrics import quiet_libraries

    host_malloc.configure()
    logging.use_absl_handler()  # as under specjax.main: INFO progress lines, orbax quiet
    logging.set_verbosity(logging.INFO)
    quiet_libraries()
    enable_cache(cache_dir)  # the parent's persistent compilation cache
    try:
        conn.send(('ok', run_here(stage, cfg, wd, workdir)))
    except BaseException:
        traceback.print_exc()
        conn.send(('error', traceback.format_exc()))
        sys.exit(1)


class StageFailed(RuntimeError):
    """A stage run in a child process raised; the message holds its traceback."""


def run_pool(workdir, stages, prepare, finished, progress, n_workers) -> None:
    """Runs `stages` (pipeline order), up to n_workers concurrent ones at once in child processes.

    prepare(stage) -> (cfg, wd) runs before a stage starts; finished(stage, (seconds, cpu),
    beside, log) -> bool after it ends (False: it was preempted; start nothing more). A stage
    starts once its prereqs and `after` stages (those selected) are done; a non-concurrent one
    waits until nothing else runs and then runs alone, in this process. SIGTERM reaches every
    child (each checkpoints); with none running it stops this process as without the pool.
    """
    _Pool(workdir, stages, prepare, finished, progress, n_workers).run()


class _Pool:
    """run_pool's state: pending stages, running children {name: (proc, stage, pipe, log)}."""

    def __init__(self, workdir, stages, prepare, finished, progress, n_workers):
        import jax

        self.workdir, self.prepare, self.finished = workdir, prepare, finished
        self.progress, self.n_workers = progress, n_workers
        self.ctx = multiprocessing.get_context('spawn')
        self.cache_dir = jax.config.jax_compilation_cache_dir or ''
        self.pending, self.running, self.done = list(stages), {}, set()
        self.selected = {s.name for s in stages}
        self.beside: dict[str, set[str]] = {}
        self.exiting, self.stopping = [], []
        self.stopped = False
        self.previous = None

    def ready(self, stage) -> bool:
        return all(p in self.done for p in (*stage.prereqs, *stage.after) if p in self.selected)

    def start(self, stage) -> None:
        cfg, wd = self.prepare(stage)
        recv, send = self.ctx.Pipe(duplex=False)
        log = os.path.join(wd, LOG_FILE)
        args = (stage, cfg, wd, self.workdir, log, self.cache_dir, send)
        proc = self.ctx.Process(target=_child, args=args)
        self.progress.begin(stage.name, sorted(self.running))
        proc.start()
        send.close()
        for other in self.running:
            self.beside[other].add(stage.name)
        self.beside[stage.name] = set(self.running)
        self.running[stage.name] = (proc, stage, recv, log)

    def stop_children(self, signum=None, frame=None) -> None:  # each child checkpoints
        if signum is not None:
            self.stopping.append(signum)
        if signum is not None and not self.running:  # a stage running here: as without a pool
            signal.signal(signal.SIGTERM, self.previous)
            os.kill(os.getpid(), signal.SIGTERM)
        for proc, *_ in self.running.values():
            proc.terminate()

    def launch_ready(self) -> None:
        """Starts what may start now; a ready non-concurrent stage runs here once idle."""
        for stage in [] if self.stopped else list(self.pending):
            if not self.ready(stage):
                continue
            if not stage.concurrent:
                if not self.running:
                    self.pending.remove(stage)
                    cfg, wd = self.prepare(stage)
                    self.progress.begin(stage.name)
                    self.done.add(stage.name)
                    times = run_here(stage, cfg, wd, self.workdir)
                    self.stopped = not self.finished(stage, times, (), '')
                break  # it runs alone: nothing after it starts first
            if len(self.running) < self.n_workers:
                self.pending.remove(stage)
                self.start(stage)

    def collect(self) -> None:
        """Waits for a child to report (or die) and records its stage."""
        names = {recv: name for name, (_, _, recv, _) in self.running.items()}
        for recv in connection.wait(list(names)):  # a result sent, or the child died
            proc, stage, recv, log = self.running.pop(names[recv])
            try:
                status, value = recv.recv()
            except EOFError:
                proc.join()
                status, value = 'error', f'the process exited with code {proc.exitcode}'
                if self.stopping:  # stopped before its training loop could checkpoint
                    status, value = 'ok', (0.0, 0.0)
            self.exiting.append(proc)  # joined at the end: its exit overlaps the next stage
            if status != 'ok':
                self.stop_children()
                for other, *_ in self.running.values():
                    other.join()
                raise StageFailed(f'stage {stage.name} failed (log: {log}):\n{value}')
            self.done.add(stage.name)
            if not self.finished(stage, value, sorted(self.beside[stage.name]), log):
                self.stopped = True

    def run(self) -> None:
        self.previous = signal.signal(signal.SIGTERM, self.stop_children)
        try:
            while self.pending or self.running:
                self.launch_ready()
                if not self.running:
                    if self.stopped:
                        return
                    if self.pending and not any(self.ready(s) for s in self.pending):
                        names = [s.name for s in self.pending]
                        raise RuntimeError(f'stages {names} cannot start')
                    continue
                self.collect()
        finally:
            signal.signal(signal.SIGTERM, self.previous)
            for proc in self.exiting:
                proc.join()
