"""specjax.host_malloc: XLA:CPU step buffers stay mapped between steps (few page faults)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specjax import host_malloc

# A jitted step whose largest buffers (2048 x 4096 float32 logits and their gradient) are above
# glibc's 32 MiB mmap ceiling, as the quickstart's draft train step's are.
_PROBE = r"""
import json, resource, sys
from specjax import host_malloc
applied = host_malloc.configure()
import jax, jax.numpy as jnp

@jax.jit
def step(w, x):
    return jax.grad(lambda w: jax.nn.logsumexp(x @ w, -1).mean())(w)

w, x = jnp.full((64, 4096), 0.01), jnp.ones((2048, 64))
for _ in range(10):  # the heap grows to the step's working set
    step(w, x).block_until_ready()
rss = []
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step(w, x).block_until_ready()
    rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps(dict(applied=applied, faults_per_step=faults / 10, rss_kb=rss)))
"""


def _probe(mode: str) -> dict:
    env = dict(os.environ, SPECJAX_MALLOC=mode, JAX_PLATFORMS='cpu')
    out = subprocess.run(
        [sys.executable, '-c', _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not sys.platform.startswith('linux') or os.confstr('CS_GNU_LIBC_VERSION') is None,
    reason='glibc only',
)
def test_step_buffers_are_reused_not_faulted_in_again():
    tuned, system = _probe('specjax'), _probe('system')
    assert tuned['applied'] and not system['applied']
    # glibc's defaults fault the two 33.5 MB buffers in on every step (about 16k pages); the
    # settings reuse them (negative control: the same step under SPECJAX_MALLOC=system).
    assert system['faults_per_step'] > 4000, system
    assert tuned['faults_per_step'] < system['faults_per_step'] / 3, (tuned, system)
    # memory is reused, not leaked: over 10 steps the peak RSS grows by at most a few of the
    # 33.5 MB buffers (the heap settling), not by the 2 x 10 a leak would add
    assert tuned['rss_kb'][-1] - tuned['rss_kb'][0] < 6 * 33_500, tuned['rss_kb']


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(host_malloc.ENV, 'tcmalloc')
    with pytest.raises(ValueError, match="SPECJAX_MALLOC='tcmalloc'"):
        host_malloc._apply()
