r"""Real checkpoints in and out of specjax workdirs.

  python -m specjax.interop import --source=smollm2-135m --workdir=/tmp/specjax/smollm2
  python -m specjax.interop import --source=gguf:/path/model.gguf --workdir=DIR
  python -m specjax.interop import --source=hf:/path/llama_dir --workdir=DIR
  python -m specjax.interop import --source=smollm2-135m --workdir=DIR --scan_layers
  python -m specjax.interop early_exit --workdir=/tmp/specjax/smollm2 \
      --out=/tmp/specjax/smollm2_exit4 --layers=4
  python -m specjax.interop export --workdir=DIR --out=HF_DIR
  python -m specjax.interop export_eagle3 --workdir=FEATURE_DRAFT_DIR --out=EAGLE3_DIR
  python -m specjax.interop export_eagle3 --workdir=FEATURE_DRAFT_DIR --out=EAGLE3_DIR --vllm_only

export_eagle3 writes a `feature_draft`-mode workdir's draft as the EAGLE-3 checkpoint (config.json +
model.safetensors) vLLM and SGLang load; --vllm_only allows a layout only vLLM loads (more than one
draft layer, norm_before_residual). --out must be new or an empty directory.

Exit status: 0 done; 2 (specjax.errors.USER_ERROR_EXIT_CODE) a refusal (a SpecjaxError, or a
ValueError / FileNotFoundError raised by specjax's own checks: a truncated file, a missing config
key), printed as one line `FATAL <message>` (with its traceback only with --verbose_errors or
SPECJAX_TRACEBACK=1); anything else a failure, with its traceback. A failed import or early exit
or export_eagle3 leaves no new files behind (specjax.interop.staging).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from absl import app, flags

from specjax import errors
from specjax.interop import workdir as wd

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMANDS = ('import', 'early_exit', 'export', 'export_eagle3')
_SOURCE = flags.DEFINE_string('source', None, f'import: one of {list(wd.SOURCE_KINDS)}')
_WORKDIR = flags.DEFINE_string('workdir', None, 'the specjax workdir written or read')
_OUT = flags.DEFINE_string(
    'out', None, 'early_exit: the draft workdir; export: the HF folder; export_eagle3: its folder'
)
_LAYERS = flags.DEFINE_integer('layers', None, 'early_exit: layers the draft keeps')
_DTYPE = flags.DEFINE_string('dtype', None, 'import: compute/parameter dtype (default float32)')
_SCAN = flags.DEFINE_bool('scan_layers', False, 'import: save the blocks stacked (one scan body)')
_VLLM_ONLY = flags.DEFINE_bool(
    'vllm_only', False, 'export_eagle3: allow n_layers > 1 / norm_before_residual (vLLM only)'
)
_VERBOSE = flags.DEFINE_bool(
    'verbose_errors', False, f'refusals print their traceback too (or {errors.TRACEBACK_ENV}=1)'
)


def _need(flag, command):
    if not flag.value and flag.value != 0:
        raise app.UsageError(f'{command} needs --{flag.name}')
    return flag.value


def main(argv):
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f'usage: python -m specjax.interop {{{"|".join(COMMANDS)}}} --flags')
    command = argv[1]
    workdir = _need(_WORKDIR, command)
    try:
        if command == 'import':
            out = wd.import_workdir(
                _need(_SOURCE, command), workdir, dtype=_DTYPE.value, scan_layers=_SCAN.value
            )
        elif command == 'early_exit':
            out = wd.early_exit_workdir(workdir, _need(_OUT, command), _need(_LAYERS, command))
        elif command == 'export':
            out = wd.export_workdir(workdir, _need(_OUT, command))
        else:
            out = wd.export_eagle3_workdir(
                workdir, _need(_OUT, command), vllm_only=_VLLM_ONLY.value
            )
    except Exception as e:
        if not errors.is_user_error(e, _PACKAGE_DIR):
            raise
        if _VERBOSE.value or os.environ.get(errors.TRACEBACK_ENV) == '1':
            traceback.print_exception(e)
        sys.stderr.write(f'FATAL {errors.one_line(e)}\n')
        sys.exit(errors.USER_ERROR_EXIT_CODE)
    print(json.dumps(out, indent=2), flush=True)


if __name__ == '__main__':
    app.run(main)
