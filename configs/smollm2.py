"""Alias of configs/spec_eval_smollm2.py, kept for one release: `--config=configs/smollm2.py`
loads configs/spec_eval_smollm2.py (the same config). Use configs/spec_eval_smollm2.py.
"""

import os

import ml_collections

from specjax.config_files import join_spec, load_config

_HERE = os.path.dirname(os.path.abspath(__file__))
_SPEC_EVAL_SMOLLM2 = os.path.join(_HERE, 'spec_eval_smollm2.py')


def get_config(arg=None) -> ml_collections.ConfigDict:
    return load_config(join_spec(_SPEC_EVAL_SMOLLM2, arg))
