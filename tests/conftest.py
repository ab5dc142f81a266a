"""Shared pytest set-up: persistent JAX compilation cache, full-precision float32 matmuls."""

from __future__ import annotations

import os

import jax
import pytest

pytest_plugins = ['data_fixtures']

_CACHE = os.environ.get(
    'SPECJAX_JAX_CACHE', os.path.join(os.path.expanduser('~'), '.cache', 'specjax', 'jax-cache')
)
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.2)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


@pytest.fixture
def highest_precision():
    """float32 matmuls at full precision, so cached/uncached paths compare within 1e-5."""
    with jax.default_matmul_precision('highest'):
        yield
