"""The training loop every mode shares: resume, checkpoints, SIGTERM, non-finite checks, metrics.

Stopping: SIGTERM anywhere inside run_loop ends it consistently (the last completed step's
checkpoint committed, or nothing saved when no step ran) with a LoopResult whose `preempted` the
entry point turns into PREEMPTED_EXIT_CODE; disk errors of a save stop it with
CheckpointWriteError (one line: the folder, the step, 'no space left on device').

A mode (pretrain, distill, cotrain) describes itself as a `Task` (its state, jitted step, eval,
data and identity) and calls `run_loop(task, workdir, config.train)`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from specjax import workdir as workdir_lib
from specjax.checkpoint import Checkpoints
from specjax.train.metrics import MetricsWriter, Progress, format_progress, log


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN/Inf; `step` is the 1-based step whose loss it was."""

    def __init__(self, step: int, value: float, last_checkpoint: int | None, directory: str):
        self.step = step
        super().__init__(
            f'non-finite training loss {value} at step {step}; stopped without saving. Last good '
            f'checkpoint: step {last_checkpoint} in {directory}'
        )


@dataclasses.dataclass
class Task:
    """What run_loop needs from a training mode."""

    mode: str  # recorded in checkpoint metadata
    init_state: Callable[[], Any]  # builds a fresh, sharded state (its .step: where to start)
    abstract_state: Any  # ShapeDtypeStructs with shardings: checkpoint restore target
    step: Callable[[Any, Any], tuple[Any, dict]]  # jitted (state, device batch) -> (state, metrics)
    batches: Any  # iterator of host batches with JSON get_state() / set_state()
    put_batch: Callable[[dict], Any]  # host batch -> global device arrays
    evaluate: Callable[[Any], dict[str, float]] | None  # state -> validation scalars
    identity: dict[str, Any]  # must match a checkpoint to resume from it (e.g. model_config)
    metadata: dict[str, Any]  # saved with each checkpoint, not compared (e.g. config)
    tokens_per_step: int  # for tokens/s
    finite_part: Callable[[Any], Any] = lambda state: state.params  # checked before each save


@dataclasses.dataclass
class LoopResult:
    state: Any
    step: int  # steps completed
    preempted: bool  # stopped early by SIGTERM / preemption, after saving
    eval: dict[str, float]  # last validation scalars ({} if none ran)
    checkpoint_step: int | None  # latest checkpoint on disk
    checkpoint_dir: str
    stopped: str = ''  # when preempted: what is saved ('stopped at step N; checkpoint step M ...')


class _Preemption:
    """SIGTERM -> a flag, installed for the whole of run_loop (set-up, steps, evaluations, saves,
    closing). It is honoured at step boundaries, before the first step, after an evaluation and
    after a save. Multi-process runs use orbax's preemption sync point at step boundaries
    instead. A request the loop did not honour (after its last check) is passed on to the
    previous handler when this one is removed (specjax.main's stop, or the default)."""

    def __init__(self):
        self.ckpts: Checkpoints | None = None
        self.multi = jax.process_count() > 1
        self.honoured = False
        self._flag = False
        self._previous = None

    def __enter__(self):
        if not self.multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, exc_type, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            if self._flag and not self.honoured and exc_type is None:
                signal.raise_signal(signal.SIGTERM)

    def _handler(self, signum, frame):
        self._flag = True

    def requested(self, step: int) -> bool:
        """At a step boundary (every process calls it at the same step)."""
        if self.multi:
            return self.ckpts.manager.reached_preemption(step)
        return self._flag

    def flagged(self) -> bool:
        """Between step boundaries: the single-process flag (multi-process: False)."""
        return self._flag


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


class _TrainMetrics:
    """Per-step metrics kept on device until a flush; flushing checks every loss is finite."""

    def __init__(self):
        self._rows: list[tuple[int, dict]] = []

    def add(self, step: int, metrics: dict) -> None:
        self._rows.append((step, metrics))

    def check(self, ckpts: Checkpoints) -> None:
        """Fetches pending rows; raises NonFiniteLossError at the first non-finite loss."""
        self._rows = [(s, jax.device_get(m)) for s, m in self._rows]
        for step, m in self._rows:
            loss = float(m['loss'])
            if not math.isfinite(loss):
                raise NonFiniteLossError(step, loss, ckpts.latest_step(), ckpts.directory)

    def pop_means(self) -> dict[str, float]:
        """Window averages of every scalar since the last pop (lr: the latest value)."""
        rows = [m for _, m in self._rows]
        self._rows = []
        if not rows:
            return {}
        out = {k: float(np.mean([float(r[k]) for r in rows])) for k in rows[0]}
        if 'lr' in rows[-1]:
            out['lr'] = float(rows[-1]['lr'])
        return out


def resume(ckpts: Checkpoints, task: Task, train_cfg):
    """(step, state, data_state) of the newest intact checkpoint, or None if there is none.

    Checks the identity and the result-changing config fields (workdir.check_config_change)
    before reading arrays; unreadable or corrupt newer steps (a digest mismatch, non-finite
    params: specjax.checkpoint_integrity) are skipped with a warning and moved to
    <workdir>/checkpoints_broken/ so their step numbers can be saved again.
    """
    if ckpts.latest_step() is None:
        return None
    config = task.metadata.get('config')
    changes = {}

    def read(step):
        ckpts.check_identity(task.identity, step)
        saved = ckpts.metadata(step).get('config')
        if config is not None and isinstance(saved, dict):  # (older checkpoints: YAML text)
            changes[step] = workdir_lib.check_config_change(
                saved,
                config,
                allow=bool(train_cfg.get('allow_config_change', False)),
                where=f'{ckpts.directory} (step {step})',
            )
        return ckpts.restore(task.abstract_state, step, finite=task.finite_part)

    step, (state, data_state, _) = ckpts.newest_readable(read)
    workdir = os.path.dirname(ckpts.directory)  # checkpoints live in <workdir>/checkpoints
    workdir_lib.record_config_change(workdir, step, changes.get(step, []))
    if ckpts.skipped:
        log(f'resuming from step {step}: newer step(s) {[s for s, _ in ckpts.skipped]} unreadable')
        ckpts.move_aside([s for s, _ in ckpts.skipped])
    return step, state, data_state


def _write_metrics(writer, ckpts, step: int, split: str, scalars: dict) -> None:
    """writer.write, but a write that fails while an async checkpoint save is in flight (a save
    filling the disk makes the metrics row fail first) reports the save's own one-line error."""
    try:
        writer.write(step, split, scalars)
    except OSError:
        ckpts.wait()  # raises CheckpointWriteError if the save failed: the cause
        raise


def run_loop(task: Task, workdir: str, train_cfg, *, on_step: Callable | None = None):
    """Trains `task` to train_cfg.steps, resuming from <workdir>/checkpoints if present.

    Holds the workdir lock. Saves every checkpoint_every steps and at the end. SIGTERM at any
    point of the call (set-up, a step, an evaluation, a save) stops at the next check: the
    current step is saved (if a step ran), the write waited for, and it returns preempted=True
    with `stopped` saying what is on disk. A non-finite loss raises NonFiniteLossError and a
    failed save CheckpointWriteError at the step it is noticed (the last good checkpoint is
    left intact either way). on_step(step, state) is called after each step (tests, custom
    hooks). metrics.jsonl rows past the resumed step are dropped (they are written again).
    """
    workdir = workdir_lib.resolve(workdir)
    with workdir_lib.hold(workdir, task.mode):
        return _run_loop(task, workdir, train_cfg, on_step)


def _run_loop(task: Task, workdir: str, train_cfg, on_step):
    with _Preemption() as preemption:
        ckpts = Checkpoints(
            workdir, keep=train_cfg.keep_checkpoints, async_save=train_cfg.async_checkpointing
        )
        preemption.ckpts = ckpts
        writer = None
        try:
            resumed = resume(ckpts, task, train_cfg)
            if resumed is not None:
                start, state, data_state = resumed
                task.batches.set_state(data_state)
                log(f'resumed from {ckpts.directory} step {start}')
            else:
                state = task.init_state()
                start = int(jax.device_get(state.step))  # > 0: continues another run (cotrain)
            writer = MetricsWriter(workdir, keep_through=start)  # rows past `start` are redone
            result = _train(task, train_cfg, on_step, ckpts, writer, preemption, state, start)
        except BaseException:
            _close(writer, ckpts, failing=True)
            raise
        _close(writer, ckpts, failing=False)
        return result


def _close(writer: MetricsWriter | None, ckpts: Checkpoints, *, failing: bool) -> None:
    """Closes the metrics writer, then the checkpoint manager (both, whatever the first does).
    A close failing with OSError is raised after both ran, unless another error propagates
    (`failing`: the same full disk flushing the metrics must not replace it)."""
    error = None
    for close in ([writer.close] if writer is not None else []) + [ckpts.close]:
        try:
            close()
        except OSError as e:
            error = error or e
    if error is not None and not failing:
        raise error


def _stopped(preemption: _Preemption, ckpts: Checkpoints, state, step: int, last_eval):
    """The preempted LoopResult once the last save is committed, saying what is on disk."""
    ckpts.wait()
    saved = ckpts.latest_step()
    if saved is None:
        text = 'stopped before any step; nothing saved'
    else:
        text = f'stopped at step {step}; checkpoint step {saved} is in {ckpts.directory}'
    log(f'preempted (SIGTERM): {text}; rerun the same command to resume')
    preemption.honoured = True
    return LoopResult(state, step, True, last_eval, saved, ckpts.directory, text)


def _train(task, train_cfg, on_step, ckpts, writer, preemption, state, start) -> LoopResult:
    total = int(train_cfg.steps)
    metadata = dict(task.metadata, **task.identity, mode=task.mode)
    pending = _TrainMetrics()
    progress = Progress(start, total, task.tokens_per_step)
    last_eval, eval_step = {}, None
    step = start

    def evaluate():
        nonlocal last_eval, eval_step
        t0 = time.perf_counter()
        last_eval, eval_step = task.evaluate(state), step
        _write_metrics(writer, ckpts, step, 'eval', last_eval)
        log(f'eval step {step}: ' + '  '.join(f'{k} {v:.4f}' for k, v in last_eval.items()))
        progress.pause(time.perf_counter() - t0)

    if preemption.flagged():  # during set-up (resume, init, compiling the init)
        return _stopped(preemption, ckpts, state, step, last_eval)
    while step < total:
        first = step == start
        t0 = time.perf_counter()
        state, metrics = task.step(state, task.put_batch(next(task.batches)))
        step += 1
        pending.add(step, metrics)
        if first:
            jax.block_until_ready(metrics)
            log(f'step {step}: first step (compile + run) took {time.perf_counter() - t0:.1f} s')
            progress = Progress(step, total, task.tokens_per_step)
        if on_step is not None:
            on_step(step, state)
        stop = preemption.requested(step)
        save = stop or step == total or _due(step, train_cfg.checkpoint_every)
        if preemption.multi:
            pass  # processes check together, in the save itself
        elif save:
            ckpts.wait()  # a failed async save stops training before this step is logged
        else:
            ckpts.check_saves()  # ... or here, at once, if it has already finished
        if save or _due(step, train_cfg.log_every):
            pending.check(ckpts)
        if _due(step, train_cfg.log_every) or step == total:
            scalars = pending.pop_means()
            scalars.update(progress.update(step))
            _write_metrics(writer, ckpts, step, 'train', scalars)
            log(format_progress(step, total, scalars))
        eval_due = _due(step, train_cfg.eval_every) or step == total
        if task.evaluate and eval_due and not stop:
            evaluate()
            if preemption.flagged():  # SIGTERM during the evaluation: save this step, stop
                stop = save = True
                pending.check(ckpts)
        if save:
            t0 = time.perf_counter()
            ckpts.save(
                step,
                state,
                data_state=task.batches.get_state(),
                metadata=metadata,
                finite=task.finite_part(state),
            )
            progress.pause(time.perf_counter() - t0)
            stop = stop or preemption.flagged()  # SIGTERM during the save
        if stop:
            return _stopped(preemption, ckpts, state, step, last_eval)
    if task.evaluate and eval_step != step:
        evaluate()
    ckpts.wait()
    if preemption.flagged():  # during the final evaluation or the last save's commit
        return _stopped(preemption, ckpts, state, step, last_eval)
    return LoopResult(state, step, False, last_eval, ckpts.latest_step(), ckpts.directory)
