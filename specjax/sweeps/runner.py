"""Sweep runner: prerequisites once, then every (configuration, seed) point in its own process.

Run as `python -m specjax.main --config=configs/ablations/<name>.py[:arg] --workdir=DIR`
(config.mode == 'sweep'; the section is described in specjax/sweeps/spec.py).

Layout under DIR: prereq/<name>/ and points/<point>/, each with `sweep.log` (command line and
the process's output, appended per attempt) and `sweep_status.json` (status, command, timing, the
sha256 of results.json). A point is finished when its status is 'complete': the process exited 0
and wrote a JSON object to results.json. Finished points are skipped on restart and never written
to again; a finished point recorded with other settings stops the sweep before anything runs. A
failing point is logged and the sweep goes on; prerequisites must succeed. After each point
DIR/summary.{md,csv,json} are rewritten, plots go to DIR/plots/ at the end, and the call raises
SweepFailed (after writing them) if any point failed.

Processes (specjax.sweeps.processes, specjax.sweeps.lifetime): the sweep holds DIR's workdir
lock (and each point its own). Each point runs in its own process group with SPECJAX_RUNNER_PID
in its environment, which makes specjax.main ask Linux to SIGKILL it when the runner dies
(prctl(PR_SET_PDEATHSIG)), so even `kill -9` of the runner leaves no point behind. SIGTERM or
SIGINT to the runner is forwarded to the running point's group (killed after
processes.STOP_GRACE_S, or at once on a second signal); the point is marked 'interrupted' and
the runner stops: on SIGTERM it returns {'preempted': True} (specjax.main then exits with
PREEMPTED_EXIT_CODE), on SIGINT it raises KeyboardInterrupt. A status never reads 'running'
once the runner that wrote it has ended (spec.read_status); on restart such a point is marked
'interrupted' first, reported, and run again: its workdir resumes from its own checkpoints.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import shlex
import signal
import sys
import time

import ml_collections

from specjax import jsonio
from specjax import workdir as workdir_lib
from specjax.sweeps import aggregate, lifetime
from specjax.sweeps.processes import (  # noqa: F401 (Launch, Launcher re-exported)
    Children,
    Forwarding,
    Launch,
    Launcher,
    subprocess_launcher,
)
from specjax.sweeps.spec import (
    LOG_FILE,
    RESULTS_FILE,
    STATUS_FILE,
    Run,
    SweepPlan,
    format_override,
    plan_sweep,
    point_dir,
    read_status,
    same_identity,
    sha256_file,
)


class SweepFailed(RuntimeError):
    """Raised at the end of a sweep in which some points failed (summary is written first)."""


def default_sweep_config() -> ml_collections.ConfigDict:
    """config.sweep with every field the runner reads; sweep configs fill in base and grid."""
    c = ml_collections.ConfigDict()
    c.base = ''  # 'path/to/config.py[:arg]' run at every point
    c.prereqs = ()  # ({'name': ..., 'config': 'path.py[:arg]', 'overrides': {...}}, ...)
    c.overrides = ()  # ((dotted_field, value), ...) for every point; '${prereq.NAME}' = its workdir
    c.grid = ()  # ((dotted_field, (value, ...)), ...): product of values
    c.variants = ()  # ((name, {dotted_field: value}), ...): extra points outside the product
    c.seeds = 3  # number of seeds per configuration; each point sets config.seed
    c.first_seed = 0  # seeds are first_seed .. first_seed + seeds - 1
    c.metrics = ()  # results.json keys (dotted for nested) in the summary; () = all numbers
    c.minimize = ()  # metrics where lower is better (with metrics=(): also names with 'loss')
    c.confidence = 0.95  # bootstrap confidence level for the intervals over seeds
    c.bootstrap_resamples = 2000  # percentile bootstrap resamples
    c.bootstrap_seed = 0  # RNG seed of the bootstrap (fixed: summaries are reproducible)
    c.plot_metrics = ()  # metrics plotted to <workdir>/plots (() = the summary's metrics)
    c.point_timeout_s = 0.0  # kill a point after this many seconds (0: no limit)
    c.compilation_cache = True  # share a JAX compilation cache in <workdir>/jax_cache
    c.dry_run = False  # validate and print the commands, run nothing
    return c


ENTRY = ('-m', 'specjax.main')


def command(run: Run, workdir: str, entry: tuple[str, ...] = ENTRY) -> tuple:
    """argv of one run: this interpreter, the entry point, --config, --workdir, overrides."""
    overrides = [format_override(k, v) for k, v in run.resolved]
    return (
        sys.executable,
        *entry,
        f'--config={run.config.flag}',
        f'--workdir={workdir}',
        *overrides,
    )


def is_complete(workdir: str, run: Run) -> bool:
    status = read_status(workdir)
    if not status or status.get('status') != 'complete':
        return False
    return run.kind == 'prereq' or os.path.isfile(os.path.join(workdir, RESULTS_FILE))


def _write_json(path: str, obj) -> None:
    jsonio.write_text(path, json.dumps(obj, indent=2, sort_keys=False) + '\n')


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec='seconds')


def check_workdir(plan: SweepPlan) -> list[tuple[str, str]]:
    """ValueError if a finished run in the workdir was recorded with other settings.

    Returns (dir, reason) for unfinished runs recorded with other settings: their checkpoints
    must not be resumed, so the caller moves them aside before running.
    """
    stale, moved = [], []
    for run in plan.prereqs + plan.points:
        wd = point_dir(plan, run)
        status = read_status(wd)
        if not status or same_identity(status.get('identity'), run.identity()):
            continue
        note = f'{wd}: recorded {status.get("identity")}, sweep now {run.identity()}'
        (stale if status.get('status') == 'complete' else moved).append((wd, note))
    if stale:
        raise ValueError(
            'Finished runs in the workdir differ from this sweep config (they are never '
            'overwritten; use another --workdir or remove them):\n  '
            + '\n  '.join(note for _, note in stale)
        )
    return moved


def move_aside(plan: SweepPlan, moved: list[tuple[str, str]]) -> None:
    """Renames unfinished runs with other settings to <workdir>/stale/<name>.<time>."""
    stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
    for wd, note in moved:
        dest = os.path.join(plan.workdir, 'stale', f'{os.path.basename(wd)}.{stamp}')
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(wd, dest)
        print(f'[sweep] moved unfinished run with other settings to {dest} ({note})', flush=True)


def _environment(plan: SweepPlan, sweep) -> dict:
    env = dict(os.environ, **{workdir_lib.RUNNER_PID_ENV: str(os.getpid())})
    if sweep.compilation_cache and 'JAX_COMPILATION_CACHE_DIR' not in env:
        env['JAX_COMPILATION_CACHE_DIR'] = os.path.join(plan.workdir, 'jax_cache')
        env.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.1')
    return env


def execute(plan: SweepPlan, run: Run, launcher: Launcher, env: dict, timeout_s, entry) -> bool:
    """Runs one prerequisite or point unless finished; True when it is complete afterwards."""
    wd = point_dir(plan, run)
    if is_complete(wd, run):
        print(f'[sweep] {run.kind} {run.name}: finished earlier, skipped', flush=True)
        return True
    if Children.stop_signal is not None:
        return False  # a stop was asked for: start nothing more
    os.makedirs(wd, exist_ok=True)
    argv = command(run, wd, entry)
    log_path = os.path.join(wd, LOG_FILE)
    record = {
        'name': run.name,
        'kind': run.kind,
        'label': run.label,
        'seed': run.seed,
        'fields': [[k, v] for k, v in run.fields],
        'identity': run.identity(),
        'command': shlex.join(argv),
        'log': LOG_FILE,
        'status': 'running',
        'started': _now(),
        'runner': lifetime.runner_identity(),
    }
    _write_json(os.path.join(wd, STATUS_FILE), record)
    with open(log_path, 'a') as log:
        log.write(f'[sweep] {_now()} {shlex.join(argv)}\n')
    print(f'[sweep] {run.kind} {run.name}: running (log {log_path})', flush=True)
    start, cpu = time.perf_counter(), _children_cpu_s()
    returncode = launcher(Launch(run, wd, argv, log_path, env, timeout_s))
    record['duration_s'] = round(time.perf_counter() - start, 2)
    record['cpu_s'] = round(_children_cpu_s() - cpu, 2)  # user + system time of the process
    record['returncode'] = returncode
    record['finished'] = _now()
    results_path = os.path.join(wd, RESULTS_FILE)
    error = None
    if Children.stop_signal is not None and returncode != 0:
        record['status'] = 'interrupted'
        record['error'] = f'runner got signal {Children.stop_signal}; exit status {returncode}'
        _write_json(os.path.join(wd, STATUS_FILE), record)
        print(f'[sweep] {run.kind} {run.name}: interrupted ({record["error"]})', flush=True)
        return False
    if returncode != 0:
        error = f'exit status {returncode}'
    elif run.kind == 'point':
        try:
            with open(results_path) as f:
                results = json.load(f)
            if not isinstance(results, dict):
                error = f'{RESULTS_FILE} holds {type(results).__name__}, not an object'
            else:
                record['results_sha256'] = sha256_file(results_path)
        except (OSError, json.JSONDecodeError) as e:
            error = f'no readable {RESULTS_FILE}: {e}'
    record['status'] = 'failed' if error else 'complete'
    if error:
        record['error'] = error
    _write_json(os.path.join(wd, STATUS_FILE), record)
    outcome = f'FAILED ({error}; see {log_path})' if error else 'complete'
    print(f'[sweep] {run.kind} {run.name}: {outcome} in {record["duration_s"]} s', flush=True)
    return not error


def run(
    config: ml_collections.ConfigDict,
    workdir: str,
    launcher: Launcher | None = None,
    entry: tuple[str, ...] = ENTRY,
) -> dict:
    """Runs the sweep in `config.sweep` under `workdir`; returns the summary (see aggregate).

    launcher runs one Launch and returns its exit status (default: a subprocess of Launch.argv);
    entry is what follows the interpreter in argv (tests point it at a fake script).
    """
    sweep = config.sweep
    unknown = sorted(set(sweep.keys()) - set(default_sweep_config().keys()))
    if unknown:
        raise ValueError(f'Unknown config.sweep field(s) {unknown}')
    plan = plan_sweep(sweep, workdir)
    metrics = set(sweep.metrics)
    for name in ('minimize', 'plot_metrics'):
        if metrics and not set(sweep[name]) <= metrics:
            raise ValueError(
                f'config.sweep.{name} {sorted(set(sweep[name]) - metrics)} not in '
                f'config.sweep.metrics {sorted(metrics)}'
            )
    moved = check_workdir(plan)
    if sweep.dry_run:
        for r in plan.prereqs + plan.points:
            print(shlex.join(command(r, point_dir(plan, r), entry)))
        return {}
    launcher = launcher or subprocess_launcher
    os.makedirs(plan.workdir, exist_ok=True)
    with workdir_lib.opened(plan.workdir, 'sweep', results=()), Forwarding():
        return _run(plan, sweep, moved, launcher, entry)


def _stopped(plan, sweep) -> dict | None:
    """After a forwarded signal: the partial summary; SIGINT re-raises KeyboardInterrupt."""
    sig = Children.stop_signal
    if sig is None:
        return None
    summary = aggregate.write_summary(plan, sweep)
    print(f'[sweep] stopped by signal {sig}; rerun the same command to continue', flush=True)
    if sig == signal.SIGINT:
        raise KeyboardInterrupt
    return dict(summary, preempted=True)


def reclaim_abandoned(plan: SweepPlan) -> None:
    """Marks 'interrupted' every run whose status still says 'running' (its runner is gone:
    this process holds the sweep's lock) and says so; they run again and resume."""
    for run in plan.prereqs + plan.points:
        wd = point_dir(plan, run)
        status = read_status(wd)
        if not status or status.get('status') not in ('running', 'interrupted'):
            continue
        reported = not status.get('abandoned') or status.get('reclaimed')
        if status['status'] == 'interrupted' and reported:
            continue  # stopped by a signal, or already reported
        runner = status.get('runner') or {}
        print(
            f'[sweep] {run.kind} {run.name}: left running by runner pid {runner.get("pid")} on '
            f'{runner.get("host")!r} (started {status.get("started")}), which is gone; marked '
            'interrupted, it runs again (it resumes from its checkpoints)',
            flush=True,
        )
        error = status.get('error') or f'runner pid {runner.get("pid")} ended while it ran'
        record = dict(status, status='interrupted', error=error, abandoned=True, reclaimed=_now())
        _write_json(os.path.join(wd, STATUS_FILE), record)


def _run(plan, sweep, moved, launcher, entry) -> dict:
    move_aside(plan, moved)
    reclaim_abandoned(plan)
    env = _environment(plan, sweep)
    timeout_s = float(sweep.point_timeout_s) or None
    start = time.perf_counter()
    for prereq in plan.prereqs:
        ok = execute(plan, prereq, launcher, env, timeout_s, entry)
        stopped = _stopped(plan, sweep)
        if stopped is not None:
            return stopped
        if not ok:
            raise SweepFailed(f'Prerequisite {prereq.name} failed; see {point_dir(plan, prereq)}')
    failed = []
    for i, point in enumerate(plan.points):
        print(f'[sweep] point {i + 1}/{len(plan.points)}', flush=True)
        if not execute(plan, point, launcher, env, timeout_s, entry):
            failed.append(point.name)
        stopped = _stopped(plan, sweep)
        if stopped is not None:
            return stopped
        summary = aggregate.write_summary(plan, sweep)
    from specjax.sweeps import plots  # matplotlib only where plots are made

    plots.write_plots(summary, os.path.join(plan.workdir, 'plots'), sweep.plot_metrics)
    print(f'[sweep] done in {time.perf_counter() - start:.0f} s: {plan.workdir}/summary.md')
    if failed:
        raise SweepFailed(f'{len(failed)} point(s) failed: {failed}; summary written anyway')
    return summary
