"""Metrics sinks for every training mode: <workdir>/metrics.jsonl, TensorBoard events, progress."""

from __future__ import annotations

import json
import logging as pylogging
import math
import os
import time

import jax
from absl import logging

from specjax import workdir as workdir_lib
from specjax.jsonio import write_text


def _step_of(line: str) -> int | None:
    """The 'step' of a metrics.jsonl row, None for a torn or foreign line."""
    try:
        return int(json.loads(line)['step'])
    except (ValueError, KeyError, TypeError):
        return None


def _jsonable(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)


class MetricsWriter:
    """Appends one JSON row per (step, split) to metrics.jsonl and scalars to TensorBoard.

    Only process 0 writes. keep_through (the step a run resumes from): rows of later steps,
    written by a run stopped after its last checkpoint, are dropped first (the file is rewritten
    atomically), so a resumed run writes each step's rows once. Locally the JSONL file is then
    opened in append mode. Object stores (gs://) cannot append, so there the file is rewritten
    whole (old rows + new) at every write. TensorBoard writes a fresh event file per run.
    """

    def __init__(self, workdir, *, keep_through: int | None = None):
        self._enabled = jax.process_index() == 0
        self._file = None
        self._tb = None
        self._remote_rows: list[str] | None = None
        if self._enabled:
            root = workdir_lib.path(workdir)
            root.mkdir(parents=True, exist_ok=True)
            self._path = root / 'metrics.jsonl'
            rows = self._kept_rows(keep_through)
            if workdir_lib._is_local(root):
                self._file = self._path.open('a')
            else:
                self._remote_rows = rows
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=os.fspath(root / 'tensorboard'))

    def _kept_rows(self, keep_through: int | None) -> list[str]:
        """The file's lines, less (rewriting it) rows after step keep_through and torn lines."""
        if not self._path.exists():
            return []
        lines = self._path.read_text().splitlines(keepends=True)
        if keep_through is None:
            return lines
        kept = [line for line in lines if _step_of(line) is not None]
        kept = [line for line in kept if _step_of(line) <= keep_through]
        if len(kept) != len(lines):
            write_text(self._path, ''.join(kept))
            logging.info(
                'metrics.jsonl: dropped %d row(s) after step %d (written again from the '
                'checkpoint)',
                len(lines) - len(kept),
                keep_through,
            )
        return kept

    def write(self, step: int, split: str, scalars: dict[str, float]) -> None:
        """Writes `scalars` for `split` ('train', 'eval', ...) at `step`."""
        if not self._enabled:
            return
        row = {'step': int(step), 'split': split, 'time': round(time.time(), 3)}
        row.update({k: _jsonable(v) for k, v in scalars.items()})
        line = json.dumps(row) + '\n'
        if self._remote_rows is None:
            self._file.write(line)
            self._file.flush()
        else:
            self._remote_rows.append(line)
            self._path.write_text(''.join(self._remote_rows))
        for key, value in scalars.items():
            self._tb.add_scalar(f'{split}/{key}', float(value), int(step))
        self._tb.flush()

    def close(self) -> None:
        if self._enabled:
            if self._file is not None:
                self._file.close()
            self._tb.close()


# orbax notices logged each time a reader opens checkpoints read-only (spec_eval, serving, a
# distillation teacher): by design here, so dropped (the tiny SmolLM2 run printed 21 copies)
_READ_ONLY_NOTICES = ('Given directory is read only', 'CheckpointManagerOptions.read_only=True')


class _QuietLibraries(pylogging.Filter):
    """Drops orbax's per-save INFO chatter and its read-only notices. Its other warnings and
    errors, and asyncio's about orbax's tasks ('Task exception was never retrieved' after a
    failed save), show as their message line without the traceback: a failed save is raised as
    CheckpointWriteError naming it."""

    def filter(self, record):
        orbax = '/orbax/' in record.pathname
        if not orbax and not (record.name == 'asyncio' and '/orbax/' in record.getMessage()):
            return True
        if str(record.msg).startswith(_READ_ONLY_NOTICES):
            return False
        if record.levelno >= pylogging.WARNING:
            record.exc_info, record.exc_text = None, None
            return True
        return False


def quiet_libraries() -> None:
    """Drops orbax's per-save INFO lines from absl's handler (specjax.main, stage processes)."""
    logging.get_absl_handler().addFilter(_QuietLibraries())


class Progress:
    """Throughput and ETA from wall time between log points (excludes eval/checkpoint pauses)."""

    def __init__(self, start_step: int, total_steps: int, tokens_per_step: int):
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self._last_step = start_step
        self._last_time = time.perf_counter()
        self._paused = 0.0

    def pause(self, seconds: float) -> None:
        """Excludes `seconds` (spent on eval or checkpoints) from the next throughput figure."""
        self._paused += seconds

    def update(self, step: int) -> dict[str, float]:
        """Returns {'steps_per_s', 'tokens_per_s', 'eta_s'} since the previous update."""
        now = time.perf_counter()
        elapsed = max(now - self._last_time - self._paused, 1e-9)
        steps_per_s = (step - self._last_step) / elapsed
        self._last_step, self._last_time, self._paused = step, now, 0.0
        eta = (self.total_steps - step) / steps_per_s if steps_per_s > 0 else float('inf')
        return {
            'steps_per_s': steps_per_s,
            'tokens_per_s': steps_per_s * self.tokens_per_step,
            'eta_s': eta,
        }


def format_progress(step: int, total: int, scalars: dict[str, float]) -> str:
    """One progress line: step, loss, tokens/s, ETA."""
    eta = scalars.get('eta_s', float('nan'))
    eta_str = time.strftime('%H:%M:%S', time.gmtime(eta)) if math.isfinite(eta) else '?'
    return (
        f'step {step}/{total}  loss {scalars.get("loss", float("nan")):.4f}  '
        f'{scalars.get("tokens_per_s", 0.0):,.0f} tok/s  ETA {eta_str}'
    )


def log(message: str) -> None:
    """Progress output: absl INFO (shown by `python -m specjax.main`) on process 0."""
    if jax.process_index() == 0:
        logging.info(message)
