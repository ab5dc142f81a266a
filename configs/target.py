"""Alias of configs/pretrain.py, kept for one release: `--config=configs/target.py[:arg]` loads
configs/pretrain.py with the same argument (same presets, same config). Use configs/pretrain.py.
"""

import os

import ml_collections

from specjax.config_files import join_spec, load_config

_PRETRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'pretrain.py')


def get_config(arg=None) -> ml_collections.ConfigDict:
    return load_config(join_spec(_PRETRAIN, arg))
