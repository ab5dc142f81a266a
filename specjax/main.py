"""specjax entry point; each config file's docstring holds its exact run command:

  python -m specjax.main --config=configs/x.py:arg --workdir=DIR [--config.a.b=v]

Loads the ml_collections config, then calls the library function for `config.mode` with
(config, workdir); every mode opens its workdir through specjax.workdir.opened and returns a
result that specjax.workdir.was_preempted reads. Exit status: 0 done, PREEMPTED_EXIT_CODE (42)
stopped by SIGTERM after the checkpoint was committed (rerun to resume), anything else a
failure.
"""

from __future__ import annotations

import importlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from specjax.parallel.distributed import initialize_from_env
from specjax.train.metrics import quiet_libraries
from specjax.workdir import PREEMPTED_EXIT_CODE, die_with_runner, was_preempted

# mode -> 'module:function' taking (config, workdir); imported only when chosen.
MODES = {
    'pretrain': 'specjax.train.pretrain:pretrain',
    'distill': 'specjax.distill.distill_mode:run_distill',
    'cotrain': 'specjax.distill.cotrain:run_cotrain',
    'spec_eval': 'specjax.evaluation.spec_eval:run',
    'sweep': 'specjax.sweeps.runner:run',
    'quickstart': 'specjax.quickstart.pipeline:run',
}

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file: path[:arg].')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory: checkpoints, metrics, results.')
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
        sys.exit(f'FATAL flags error: {e}\nPass --helpfull to see help on flags.')
    except (AttributeError, KeyError) as e:
        while isinstance(e, BaseException) and e.args:  # ml_collections nests KeyError in ...
            e = e.args[0]
        sys.exit(f'FATAL unknown config field in {bad_overrides(argv, str(e))}: {e}')


def bad_overrides(argv, message: str) -> list[str]:
    """The --config.a.b=v flags whose dotted path holds the unknown key quoted in `message`."""
    overrides = [a for a in argv[1:] if a.startswith('--config.')]
    key = message.split("'")[1] if message.count("'") >= 2 else message
    path = lambda a: a[len('--config.') :].split('=', 1)[0].split('.')
    return [a for a in overrides if key in path(a)] or overrides


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    die_with_runner()  # a sweep point dies with its runner (no-op otherwise)
    initialize_from_env()  # multi-process runs (launch/); a no-op on one machine
    config = _CONFIG.value
    run = resolve_mode(config.get('mode'))
    quiet_libraries()
    logging.info(
        'mode %s, workdir %s, config: %s',
        config.mode,
        _WORKDIR.value,
        config.to_json_best_effort(sort_keys=True),
    )
    result = run(config, _WORKDIR.value)
    if was_preempted(result):
        sys.exit(PREEMPTED_EXIT_CODE)  # the checkpoint is committed; launchers restart on this


if __name__ == '__main__':
    app.run(main, flags_parser=parse_flags)
