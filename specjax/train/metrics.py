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


def _jsonable(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)


class MetricsWriter:
    """Appends one JSON row per (step, split) to metrics.jsonl and scalars to TensorBoard.

    Only process 0 writes. Locally the JSONL file is opened in append mode: a resumed run adds
    rows after the previous run's, nothing is rewritten. Object stores (gs://) cannot append, so
    there the file is rewritten whole (old rows + new) at every write. TensorBoard writes a fresh
    event file per run.
    """

    def __init__(self, workdir):
        self._enabled = jax.process_index() == 0
        self._file = None
        self._tb = None
        self._remote_rows: list[str] | None = None
        if self._enabled:
            root = workdir_lib.path(workdir)
            root.mkdir(parents=True, exist_ok=True)
            self._path = root / 'metrics.jsonl'
            if workdir_lib._is_local(root):
                self._file = self._path.open('a')
            else:
                self._remote_rows = [self._path.read_text()] if self._path.exists() else []
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=os.fspath(root / 'tensorboard'))

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


class _QuietLibraries(pylogging.Filter):
    """Drops orbax's per-save INFO chatter; warnings and errors still show."""

    def filter(self, record):
        return record.levelno >= pylogging.WARNING or '/orbax/' not in record.pathname


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
