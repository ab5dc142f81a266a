"""specjax entry point; each config file's docstring holds its exact run command:

  python -m specjax.main --config=configs/x.py:arg --workdir=DIR [--config.a.b=v]

Loads the ml_collections config, writes it to <workdir>/invocations/<time>-pid<pid>.json (one
file per invocation, so no run's record replaces another's; the log names the file; a refused
run withdraws it), then calls the library function for `config.mode` with (config, workdir);
every mode opens its workdir through specjax.workdir.opened and returns a result that
specjax.workdir.was_preempted reads.

Exit status: 0 done; PREEMPTED_EXIT_CODE (42) stopped by SIGTERM with the workdir consistent
(a training loop commits its checkpoint first; SIGTERM anywhere else unwinds the run through
specjax.errors.StopRequested; the last line says what is saved): rerun to resume;
USER_ERROR_EXIT_CODE (2) a refusal (specjax.errors.is_user_error: a SpecjaxError, a busy
workdir, or a ValueError / FileNotFoundError / ImportError raised by specjax's own checks),
printed as one line `FATAL <message>` (after its traceback only with --verbose_errors or
SPECJAX_TRACEBACK=1); anything else a failure, with its traceback.
"""

from __future__ import annotations

import os
import signal

if __name__ == '__main__':  # SIGTERM while importing (seconds): nothing is written yet, stop now
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(42))  # PREEMPTED_EXIT_CODE

import datetime  # noqa: E402
import importlib  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from specjax import errors, jsonio  # noqa: E402
from specjax import workdir as workdir_lib  # noqa: E402
from specjax.parallel.distributed import initialize_from_env  # noqa: E402
from specjax.sweeps.lifetime import die_with_runner  # noqa: E402
from specjax.train.metrics import quiet_libraries  # noqa: E402
from specjax.workdir import PREEMPTED_EXIT_CODE, was_preempted  # noqa: E402

# mode -> 'module:function' taking (config, workdir); imported only when chosen.
MODES = {
    'pretrain': 'specjax.train.pretrain:pretrain',
    'distill': 'specjax.distill.distill_mode:run_distill',
    'cotrain': 'specjax.distill.cotrain:run_cotrain',
    'feature_draft': 'specjax.distill.feature_mode:run_feature_draft',
    'online_distill': 'specjax.quickstart.online:run',  # imports config.target.source first
    'spec_eval': 'specjax.evaluation.spec_eval:run',
    'sweep': 'specjax.sweeps.runner:run',
    'quickstart': 'specjax.quickstart.pipeline:run',
}
INVOCATIONS_DIR = 'invocations'  # <workdir>/invocations/<time>-pid<pid>.json: argv and config
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file: path[:arg].')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory: checkpoints, metrics, results.')
_VERBOSE_ERRORS = flags.DEFINE_bool(
    'verbose_errors', False, f'Refusals print their traceback too (or {errors.TRACEBACK_ENV}=1).'
)
flags.mark_flags_as_required(['config', 'workdir'])


def resolve_mode(mode):
    """The callable for `mode`; ValueError listing the known modes otherwise."""
    if mode not in MODES:
        raise ValueError(f'config.mode={mode!r} is not a known mode; known: {sorted(MODES)}')
    module, _, name = MODES[mode].partition(':')
    return getattr(importlib.import_module(module), name)


def parse_flags(argv):
    """absl flag parsing that turns an unknown --config.x.y override into a one-line error."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        text = str(e)
        if 'Traceback (most recent call last)' in text:  # get_config raised: keep its last line
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            text = f'{text.split("Traceback")[0].strip()} {lines[-1]}'
        _refuse(f'flags error: {text}', '(pass --helpfull to see help on flags)')
    except (AttributeError, KeyError) as e:
        while isinstance(e, BaseException) and e.args:  # ml_collections nests KeyError in ...
            e = e.args[0]
        _refuse(f'unknown config field in {bad_overrides(argv, str(e))}: {e}')


def _refuse(message: str, hint: str = '') -> None:
    """Prints `FATAL <message>` (one line) and a hint, exits USER_ERROR_EXIT_CODE."""
    sys.stderr.write(f'FATAL {" ".join(message.split())}\n' + (f'{hint}\n' if hint else ''))
    sys.exit(errors.USER_ERROR_EXIT_CODE)


def bad_overrides(argv, message: str) -> list[str]:
    """The --config.a.b=v flags whose dotted path holds the unknown key quoted in `message`."""
    overrides = [a for a in argv[1:] if a.startswith('--config.')]
    key = message.split("'")[1] if message.count("'") >= 2 else message
    path = lambda a: a[len('--config.') :].split('=', 1)[0].split('.')
    return [a for a in overrides if key in path(a)] or overrides


def _stop(signum, frame):
    """SIGTERM wherever no mode handles it (modes install their own around training loops)."""
    raise errors.StopRequested(signum)


class Invocation:
    """<workdir>/invocations/<time>-pid<pid>.json: argv, mode and the resolved config of this
    run (the log names the file instead of printing the config). Withdrawn after a refusal,
    with the folders it created, so a refused run leaves nothing behind."""

    def __init__(self, workdir: str):
        stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
        self.folders = [workdir_lib.path(workdir), workdir_lib.path(workdir) / INVOCATIONS_DIR]
        self.file = self.folders[-1] / f'{stamp}-pid{os.getpid()}.json'
        self.created: list = []

    def record(self, config) -> str:
        self.created = [d for d in self.folders if not d.exists()]
        record = {'argv': sys.argv, 'mode': config.get('mode'), 'config': config.to_dict()}
        jsonio.write_json(os.fspath(self.file), record, sort_keys=True)
        return os.fspath(self.file)

    def withdraw(self) -> None:
        self.file.unlink(missing_ok=True)
        lock = self.folders[0] / workdir_lib.LOCK_FILE  # released by now; ours if we made the dir
        if self.folders[0] in self.created and lock.exists() and not lock.read_text().strip():
            lock.unlink()
        for folder in reversed(self.created):
            try:
                folder.rmdir()  # only if empty: the mode may have written there
            except OSError:
                break


def _process_index() -> int:
    import jax

    return jax.process_index()


def _saved(workdir: str) -> str:
    """What the workdir holds for a rerun: its newest committed checkpoint step, if any."""
    from specjax.quickstart.stage_runner import committed_steps

    steps = committed_steps(workdir)
    if not steps:
        return f'no checkpoint is committed in {workdir}; rerun the same command to continue'
    return (
        f'checkpoint step {steps[-1]} is the newest committed in {workdir}; rerun the same '
        'command to resume from it'
    )


def _fail(e: BaseException, workdir: str | None, invocation: Invocation | None):
    """Exits for a stop or a refusal; returns for anything else (the caller re-raises)."""
    if isinstance(e, errors.StopRequested):
        where = _saved(workdir) if workdir else 'nothing was written'
        sys.stderr.write(f'[specjax] stopped by signal {e.signum}: {where}\n')
        sys.exit(PREEMPTED_EXIT_CODE)
    verbose = _VERBOSE_ERRORS.value or os.environ.get(errors.TRACEBACK_ENV) == '1'
    refusal = isinstance(e, workdir_lib.WorkdirBusy) or errors.is_user_error(e, _PACKAGE_DIR)
    if not refusal:
        return
    if invocation is not None:
        invocation.withdraw()
    if verbose:
        traceback.print_exception(e)
    hint = '' if verbose else f'({errors.TRACEBACK_ENV}=1 shows the traceback)'
    _refuse(errors.one_line(e), hint)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    previous = signal.signal(signal.SIGTERM, _stop)
    workdir = invocation = None
    try:
        die_with_runner()  # a sweep point dies with its runner (no-op otherwise)
        initialize_from_env()  # multi-process runs (launch/); a no-op on one machine
        config = _CONFIG.value
        run = resolve_mode(config.get('mode'))
        quiet_libraries()
        workdir = workdir_lib.resolve(_WORKDIR.value)
        where = 'process 0'
        if _process_index() == 0:
            invocation = Invocation(workdir)
            where = invocation.record(config)
        logging.info('mode %s, workdir %s, config in %s', config.mode, workdir, where)
        result = run(config, workdir)
    except BaseException as e:  # noqa: BLE001 (stops and refusals exit here; the rest re-raise)
        _fail(e, workdir, invocation)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    # a mapping with an own .preempted (the quickstart's StageOutcomes) is read by that too
    if was_preempted(result) or getattr(result, 'preempted', False) is True:
        sys.exit(PREEMPTED_EXIT_CODE)  # the checkpoint is committed; launchers restart on this


if __name__ == '__main__':
    app.run(main, flags_parser=parse_flags)
