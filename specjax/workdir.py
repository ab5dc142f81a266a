"""What keeps a workdir consistent: one writer at a time, results owned by one mode, no drift.

- `hold(workdir, mode)`: an advisory lock (fcntl.flock on <workdir>/.lock) held for a whole run,
  naming the holder (host, pid, start time, command). A second run fails at once with
  WorkdirBusy naming the holder. The kernel drops a flock when its process dies, so a lock file
  whose holder is gone is simply taken over (with a warning naming the old holder). Only
  process 0 of a multi-process run locks; re-entering from the same process is allowed.
- `write_results(workdir, mode, results, config)`: results.json carries `mode`, the resolved
  `config`, its `config_hash` and the `digests` of the corpus and tokenizer it read; one written
  by another mode is never replaced, one of the same mode is kept beside the new one
  (`keep_previous`, the rule `write_kept` applies to any file: results.step<N>.json or .prev).
- `config_changes(saved, current)`: the result-changing fields that differ between two configs;
  IGNORED_CONFIG_FIELDS lists the ones that do not change a result (logging, checkpoint
  cadence, the mesh, paths of inputs whose identity is checked separately); DEFAULT_VALUED_FIELDS
  the ones left out while at their default (fields newer than some workdirs).
- `resolve(workdir)` / `path(workdir)`: the one spelling of a workdir (str, pathlib.Path or
  epath.Path; a local path absolute with ~ expanded, a remote `gs://` URI kept) and its
  etils.epath.Path, through which every workdir file is read and written (so `gs://` works).
- RUNNER_PID_ENV: the runner's pid, set for sweep points (specjax.sweeps.lifetime uses it);
  PREEMPTED_EXIT_CODE: a run that stopped on SIGTERM after committing its checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

from absl import logging
from etils import epath

from specjax import errors
from specjax.jsonio import to_json, write_text

LOCK_FILE = '.lock'
RESULTS_FILE = 'results.json'
PREEMPTED_EXIT_CODE = 42  # SIGTERM -> checkpoint committed -> exit 42; rerun to resume

RUNNER_PID_ENV = 'SPECJAX_RUNNER_PID'  # set by the sweep runner for its points

# Config fields that never change what a run computes, by dotted prefix. Everything else (seed,
# steps, model, data, distillation settings, optimizer, eval sizes ...) is compared on resume.
IGNORED_CONFIG_FIELDS = (
    'train.log_every',  # progress lines / metrics.jsonl rows
    'train.eval_every',  # intermediate validation passes (the final one always runs)
    'train.checkpoint_every',  # resume is bit-identical whatever the cadence
    'train.keep_checkpoints',
    'train.async_checkpointing',
    'train.allow_config_change',  # the override itself
    'mesh',  # the same computation on another topology (a resumed pod job may get another slice)
    'distill.teacher_workdir',  # the teacher's identity (config + step) is checked instead
    'data.data_dir',  # the corpus and tokenizer identities are checked instead
    'data.cache_tokens',  # the same token ids, cached or not
    'sweep.dry_run',
)

# Fields added after workdirs were recorded, by last dotted component: left out of the identity
# while at this default (an older workdir still matches); any other value is compared.
DEFAULT_VALUED_FIELDS = {
    'scan_layers': False,  # model.scan_layers, draft.scan_layers (parameter layout)
    'dynamic_greedy': False,  # eval.dynamic_greedy (spec_eval: greedy's own programs)
    'rows': 'teacher',  # draft_feature.rows (the SmolLM2 preset's feature draft's row sets)
    'draft_kind': 'model',  # spec_eval's draft: a model, or 'ngram' (training-free lookup)
    'max_n': 3,  # ngram.max_n, ngram.min_n (spec_eval's n-gram draft)
    'min_n': 1,
    'proposals_by_n': (),  # ngram.proposals_by_n (spec_eval's n-gram draft: k after any match)
    'ngram_proposals_by_n': (),  # the quickstart's serve, route and tasks n-gram draft
}


class ConfigMismatch(errors.ConfigDriftError):
    """A run's settings differ from those recorded in its workdir (a checkpoint or results); a
    ValueError."""


class WorkdirBusy(errors.WorkdirLockedError):
    """Another live process holds the workdir's lock."""


_held: dict[str, list] = {}  # realpath -> [open lock file, depth] of locks held by this process


def _is_local(workdir) -> bool:
    return '://' not in os.fspath(workdir)


def resolve(workdir) -> str:
    """The canonical string of a workdir (str, pathlib.Path or epath.Path).

    Local: absolute, `~` expanded, normalised (so one folder has one identity in metadata);
    remote (`gs://bucket/dir`): the URI unchanged but for a trailing '/'.
    """
    text = os.fspath(workdir)
    if not _is_local(text):
        return text.rstrip('/')
    return os.path.abspath(os.path.expanduser(text))


def path(workdir) -> epath.Path:
    """The workdir as an etils.epath.Path (local or remote), for every file under it."""
    return epath.Path(resolve(workdir))


def _process_index() -> int:
    if 'jax' not in sys.modules:
        return 0
    import jax

    return jax.process_index()


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0; no permission = alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict) -> str:
    return (
        f'host {holder.get("host")!r} pid {holder.get("pid")} (mode {holder.get("mode")!r}, '
        f'started {holder.get("started")}, command {holder.get("command")!r})'
    )


def read_holder(workdir: str) -> dict:
    """The JSON the last holder wrote into <workdir>/.lock ({} if none or unreadable)."""
    try:
        text = (path(workdir) / LOCK_FILE).read_text()
        return json.loads(text) if text.strip() else {}
    except (OSError, json.JSONDecodeError):
        return {}


@contextlib.contextmanager
def hold(workdir: str, mode: str):
    """Holds <workdir>/.lock for the duration; WorkdirBusy (naming the holder) if taken.

    No-op on processes other than 0 and on non-local (gs://) workdirs, which flock cannot lock.
    """
    if _process_index() != 0 or not _is_local(workdir):
        yield
        return
    workdir = resolve(workdir)
    os.makedirs(workdir, exist_ok=True)
    key = os.path.realpath(workdir)
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    f = open(os.path.join(key, LOCK_FILE), 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        raise WorkdirBusy(
            f'workdir {key} is in use by {_describe(read_holder(key))}; wait for it to finish, '
            'stop it, or use another --workdir'
        ) from None
    previous = read_holder(key)
    if previous:
        alive = previous.get('host') == socket.gethostname() and pid_alive(previous.get('pid', 0))
        note = ' (that pid is now another process)' if alive else ''
        logging.warning(
            'workdir %s: took over the lock left by %s, which has ended%s',
            key,
            _describe(previous),
            note,
        )
    f.seek(0)
    f.truncate()
    me = {
        'host': socket.gethostname(),
        'pid': os.getpid(),
        'mode': mode,
        'started': datetime.datetime.now().isoformat(timespec='seconds'),
        'command': ' '.join(sys.argv),
    }
    f.write(json.dumps(me))
    f.flush()
    _held[key] = [f, 1]
    try:
        yield
    finally:
        del _held[key]
        f.seek(0)
        f.truncate()
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _flatten(tree, prefix: str = '') -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f'{prefix}{key}.'))
        return out
    return {prefix[:-1]: tree}


def _ignored(field: str) -> bool:
    return any(field == p or field.startswith(p + '.') for p in IGNORED_CONFIG_FIELDS)


def relevant_config(config) -> dict[str, Any]:
    """Dotted field -> JSON value of every result-changing field of `config`."""
    return {
        k: v
        for k, v in _flatten(to_json(config)).items()
        if not _ignored(k) and not at_default(k, v)
    }


def at_default(field: str, value) -> bool:
    """Whether a dotted field is a DEFAULT_VALUED_FIELDS field at its default (then it counts
    as absent: a workdir written before the field existed matches)."""
    value = tuple(value) if isinstance(value, list) else value  # JSON reads a tuple as a list
    return value == DEFAULT_VALUED_FIELDS.get(field.rpartition('.')[2], object())


def config_hash(config) -> str:
    """sha256 of the result-changing fields (two configs with one hash compute the same)."""
    text = json.dumps(relevant_config(config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def config_changes(saved, current) -> list[tuple[str, Any, Any]]:
    """(field, saved value, current value) for every result-changing field that differs."""
    a, b = relevant_config(saved), relevant_config(current)
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, missing), b.get(key, missing)
        if old != new:
            out.append((key, None if old is missing else old, None if new is missing else new))
    return out


def check_config_change(saved, current, *, allow: bool, where: str) -> list:
    """ConfigMismatch naming the changed fields unless `allow` (then a warning lists them and
    they are returned: [(field, saved value, current value)], [] when nothing changed)."""
    changes = config_changes(saved, current)
    if not changes:
        return []
    text = ', '.join(f'{k}: {old!r} -> {new!r}' for k, old, new in changes)
    if allow:
        logging.warning('%s: continuing with a changed config (allowed): %s', where, text)
        return changes
    raise ConfigMismatch(
        f'config differs from the run recorded in {where} in result-changing field(s) '
        f'{[k for k, _, _ in changes]}: {text}. Use a new --workdir, the original settings, or '
        '--config.train.allow_config_change=True to extend the run deliberately (e.g. more steps)'
    )


TRAINING_MODES = ('pretrain', 'distill', 'cotrain')


def _legacy_owner(recorded: dict) -> str | None:
    """Who wrote a results.json from before 'mode' was recorded (by its keys), or None."""
    if 'checkpoint_dir' in recorded:
        return 'training'
    if {'c', 'v'} <= set(recorded) or {'runs', 'calibration'} <= set(recorded):
        return 'spec_eval'  # its results.json / spec_eval.json
    return None


def check_results_owner(workdir: str, mode: str, name: str = RESULTS_FILE) -> None:
    """ValueError if <workdir>/<name> exists and was written by another mode (or by hand)."""
    file = path(workdir) / name
    if not file.exists():
        return
    try:
        recorded = json.loads(file.read_text())
        owner = recorded.get('mode') or _legacy_owner(recorded)
    except (OSError, json.JSONDecodeError, AttributeError):
        owner = None
    if owner == 'training' and mode in TRAINING_MODES:
        return  # written before results recorded their mode; the checkpoint identity decides
    if owner != mode:
        raise ValueError(
            f'{file} was written by mode {owner!r}, not {mode!r}; it is never replaced. '
            f'Give the {mode} run its own --workdir'
        )


@contextlib.contextmanager
def opened(workdir, mode: str, results: tuple[str, ...] = (RESULTS_FILE,)):
    """The one workdir handle of every mode: yields the resolved workdir while holding its lock
    (WorkdirBusy naming the holder otherwise), after refusing it when any of `results` there
    was written by another mode. Re-entrant within a process (hold is)."""
    workdir = resolve(workdir)
    with hold(workdir, mode):
        for name in results:
            check_results_owner(workdir, mode, name)
        yield workdir


def was_preempted(result) -> bool:
    """Whether a mode's result says it stopped early on SIGTERM (checkpoint committed): a
    results mapping with 'preempted' true, or an object whose .preempted is true."""
    if getattr(result, 'preempted', None) is not None:
        return bool(result.preempted)
    if isinstance(result, Mapping):
        return bool(result.get('preempted'))
    return False


def keep_previous(workdir, name: str) -> str | None:
    """Before <workdir>/<name> is replaced: copies the existing file beside it as
    <stem>.step<N>.json (N its 'step' field) or <stem>.prev.json, numbered -2, -3, ... when that
    name holds something else (a copy with the same content is not made twice); returns the
    copy's path (None: no file). The one rule of every mode's results: a file is never replaced
    without keeping the previous one."""
    root = path(workdir)
    file = root / name
    if not file.exists():
        return None
    old = file.read_text()
    try:
        step = json.loads(old).get('step')
    except (json.JSONDecodeError, AttributeError):
        step = None
    stem = name[: -len('.json')] if name.endswith('.json') else name
    tag = f'step{step}' if isinstance(step, int) else 'prev'
    backup, n = root / f'{stem}.{tag}.json', 1
    while backup.exists():
        if backup.read_text() == old:
            return os.fspath(backup)
        n += 1
        backup = root / f'{stem}.{tag}-{n}.json'
    write_text(backup, old)
    logging.info('%s: the previous version is kept as %s', file, backup)
    return os.fspath(backup)


def write_kept(workdir, name: str, text: str) -> str:
    """Writes <workdir>/<name> atomically after keep_previous; returns its path (a str)."""
    keep_previous(workdir, name)
    file = path(workdir) / name
    write_text(file, text)
    return os.fspath(file)


CONFIG_HISTORY_FILE = 'config_history.json'


def record_config_change(workdir, step: int, changes: list) -> None:
    """Appends to <workdir>/config_history.json that the run resumed at `step` with the allowed
    `changes` [(field, before, after)] (process 0), so results record which settings the
    parameters were trained under (write_results copies the history in)."""
    if not changes or _process_index() != 0:
        return
    file = path(workdir) / CONFIG_HISTORY_FILE
    history = json.loads(file.read_text()) if file.exists() else []
    entry = {'resumed_at_step': int(step), 'changes': [[k, old, new] for k, old, new in changes]}
    if history and history[-1] == json.loads(json.dumps(entry, default=str)):
        return  # the same resume again (a crash before the next checkpoint)
    history.append(entry)
    write_text(os.fspath(file), json.dumps(history, indent=2, default=str))


def write_results(workdir: str, mode: str, results: dict, config, name: str = RESULTS_FILE):
    """Writes <workdir>/<name> with mode, config, config_hash and digests; returns its path.

    Process 0 only (others get the same path back). Refuses (ValueError) to replace a file another
    mode wrote; keeps an older one of this mode beside it (keep_previous). Adds 'config_history'
    (record_config_change) and, unless given, 'digests' (data.digests.used_digests, or None).
    """
    root = path(workdir)
    file = root / name
    if _process_index() != 0:
        return os.fspath(file)
    check_results_owner(root, mode, name)
    root.mkdir(parents=True, exist_ok=True)
    out = dict(results, mode=mode, config=to_json(config), config_hash=config_hash(config))
    data = sys.modules.get('specjax.data')  # not loaded: no corpus or tokenizer was read here
    none = {'corpus': None, 'tokenizer': None}
    out.setdefault('digests', data.used_digests(config) if data else none)
    history = root / CONFIG_HISTORY_FILE
    if history.exists():  # resumed with allowed config changes: the settings before them too
        out['config_history'] = json.loads(history.read_text())
    return write_kept(root, name, json.dumps(out, indent=2, sort_keys=True, default=str))
