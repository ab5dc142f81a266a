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


def _child(config, name, wd, workdir, log_path, cache_dir, conn) -> None:
    """A child process: logs to log_path, runs the stage, sends (seconds, cpu) or the error."""
    with open(log_path, 'a') as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    from absl import logging

    from specjax import host_malloc
    from specjax.quickstart import pipeline as quickstart
    from specjax.train.metrics import quiet_libraries

    host_malloc.configure()
    logging.use_absl_handler()  # as under specjax.main: INFO progress lines, orbax quiet
    logging.set_verbosity(logging.INFO)
    quiet_libraries()
    quickstart.enable_cache(cache_dir)  # the parent's persistent compilation cache
    try:
        stage = next(s for s in quickstart.stages_of(config) if s.name == name)
        conn.send(('ok', run_here(stage, quickstart.stage_config(config, stage), wd, workdir)))
    except BaseException:
        traceback.print_exc()
        conn.send(('error', traceback.format_exc()))
        sys.exit(1)


class StageFailed(RuntimeError):
    """A stage run in a child process raised; the message holds its traceback."""


def run_pool(config, workdir, stages, prepare, finished, progress, n_workers) -> None:
    """Runs `stages` (pipeline order), up to n_workers concurrent ones at once in child processes.

    prepare(stage) -> (cfg, wd) runs before a stage starts; finished(stage, (seconds, cpu),
    beside, log) -> bool after it ends (False: it was preempted; start nothing more). A stage
    starts once its prereqs and `after` stages (those selected) are done; a non-concurrent one
    waits until nothing else runs and then runs alone, in this process.
    """
    import jax

    ctx = multiprocessing.get_context('spawn')
    cache_dir = jax.config.jax_compilation_cache_dir or ''
    pending, running, done = list(stages), {}, set()
    selected = {s.name for s in stages}
    beside: dict[str, set[str]] = {}
    exiting, stopping = [], []

    def ready(stage):
        return all(p in done for p in (*stage.prereqs, *stage.after) if p in selected)

    def start(stage):
        cfg, wd = prepare(stage)
        recv, send = ctx.Pipe(duplex=False)
        log = os.path.join(wd, LOG_FILE)
        args = (config, stage.name, wd, workdir, log, cache_dir, send)
        proc = ctx.Process(target=_child, args=args)
        progress.begin(stage.name, sorted(running))
        proc.start()
        send.close()
        for other in running:
            beside[other].add(stage.name)
        beside[stage.name] = set(running)
        running[stage.name] = (proc, stage, recv, log)

    def stop_children(signum=None, frame=None):  # each child checkpoints on SIGTERM
        if signum is not None:
            stopping.append(signum)
        if signum is not None and not running:  # a stage running here: as without the pool
            signal.signal(signal.SIGTERM, previous)
            os.kill(os.getpid(), signal.SIGTERM)
        for proc, *_ in running.values():
            proc.terminate()

    previous = signal.signal(signal.SIGTERM, stop_children)
    try:
        stopped = False
        while pending or running:
            for stage in [] if stopped else list(pending):
                if not ready(stage):
                    continue
                if not stage.concurrent:
                    if not running:
                        pending.remove(stage)
                        cfg, wd = prepare(stage)
                        progress.begin(stage.name)
                        done.add(stage.name)
                        stopped = not finished(stage, run_here(stage, cfg, wd, workdir), (), '')
                    break  # it runs alone: nothing after it starts first
                if len(running) < n_workers:
                    pending.remove(stage)
                    start(stage)
            if not running:
                if stopped:
                    return
                if pending and not any(ready(s) for s in pending):
                    raise RuntimeError(f'stages {[s.name for s in pending]} cannot start')
                continue
            names = {recv: name for name, (_, _, recv, _) in running.items()}
            for recv in connection.wait(list(names)):  # a result sent, or the child died
                proc, stage, recv, log = running.pop(names[recv])
                try:
                    status, value = recv.recv()
                except EOFError:
                    proc.join()
                    status, value = 'error', f'the process exited with code {proc.exitcode}'
                    if stopping:  # stopped before its training loop could checkpoint
                        status, value = 'ok', (0.0, 0.0)
                exiting.append(proc)  # joined at the end: its exit overlaps the next stage
                if status != 'ok':
                    stop_children()
                    for other, *_ in running.values():
                        other.join()
                    raise StageFailed(f'stage {stage.name} failed (log: {log}):\n{value}')
                done.add(stage.name)
                if not finished(stage, value, sorted(beside[stage.name]), log):
                    stopped = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in exiting:
            proc.join()
