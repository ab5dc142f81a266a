"""Samplers refuse garbage: out-of-range ids before compiling, non-finite logits after the call.

A NaN in one weight of the target (or the draft) makes every sampler raise NonFiniteLogitsError
naming that model; prompt ids outside [0, vocab) and tree ranks >= vocab raise ValueError before
any program is built (the sampler's jit is still unbuilt afterwards). Negative control: finite
models raise nothing, and their outputs are bit-identical with the in-loop check on and off.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from sampling_models import make_model, perturbed, tiny_config

from specjax.models import split
from specjax.sampling import (
    NonFiniteLogitsError,
    SamplingConfig,
    make_autoregressive_fn,
    make_speculative_fn,
    make_tree_speculative_fn,
)

VOCAB, MAX_NEW, K, EOS = 64, 6, 3, 9
TREE = ((0,), (1,), (0, 0), (1, 0))
T1 = SamplingConfig(1.0)
PROMPTS = np.array([[5, 17, 33, 2], [60, 1, 0, 0], [8, 8, 40, 0]], np.int32)
LENGTHS = np.array([4, 2, 3], np.int32)


def with_nan(model, seed: int):
    """A copy of `model` with one element of one block matrix set to NaN (chosen by `seed`)."""
    graphdef, params = split(model)
    leaves, treedef = jax.tree.flatten(params)
    mats = [i for i, x in enumerate(leaves) if x.ndim >= 2]
    rng = np.random.default_rng(seed)
    i = mats[rng.integers(1, len(mats))]  # not the first (the embedding): every token uses it
    flat = np.array(leaves[i]).reshape(-1)
    flat[rng.integers(flat.size)] = np.nan
    leaves[i] = flat.reshape(leaves[i].shape)
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@pytest.fixture(scope='module')
def models():
    target = make_model(tiny_config(vocab_size=VOCAB, max_len=32), seed=1, scale=4.0)
    draft = perturbed(target, seed=2, noise=0.5)
    return dict(
        target=target, draft=draft, nan_target=with_nan(target, 3), nan_draft=with_nan(draft, 4)
    )


def samplers(models, check_finite=True, max_new=MAX_NEW, sampling=T1):
    """name -> (fn, which params it takes): the three samplers on the models' graphdef."""
    tgd, dgd = split(models['target'])[0], split(models['draft'])[0]
    kw = dict(max_new_tokens=max_new, sampling=sampling, eos_id=EOS, check_finite=check_finite)
    return {
        'autoregressive_sample': (make_autoregressive_fn(tgd, **kw), ('target',)),
        'speculative_sample': (make_speculative_fn(tgd, dgd, num_draft_tokens=K, **kw), None),
        'tree_speculative_sample': (make_tree_speculative_fn(tgd, dgd, tree=TREE, **kw), None),
    }


def call(fn, uses, models, target='target', draft='draft', prompts=PROMPTS):
    params = [split(models[target])[1]]
    if uses is None:
        params.append(split(models[draft])[1])
    return fn(*params, prompts, LENGTHS, 7)


def test_nan_target_raises_naming_target_in_all_three(models):
    for name, (fn, uses) in samplers(models).items():
        with pytest.raises(NonFiniteLogitsError, match=f'{name}: the target model') as err:
            call(fn, uses, models, target='nan_target')
        assert err.value.models == ('target',) and err.value.sampler == name
        assert isinstance(err.value, FloatingPointError)


@pytest.mark.parametrize('acceptance', ['probabilistic', 'strict'])
def test_nan_draft_raises_naming_draft(models, acceptance):
    tgd, dgd = split(models['target'])[0], split(models['draft'])[0]
    kw = dict(max_new_tokens=MAX_NEW, sampling=T1, eos_id=EOS)
    fns = {'speculative_sample': make_speculative_fn(tgd, dgd, num_draft_tokens=K, **kw,
                                                     acceptance=acceptance)}  # fmt: skip
    if acceptance == 'probabilistic':
        fns['tree_speculative_sample'] = make_tree_speculative_fn(tgd, dgd, tree=TREE, **kw)
    for name, fn in fns.items():
        with pytest.raises(NonFiniteLogitsError, match=f'{name}: the draft model ') as err:
            call(fn, None, models, draft='nan_draft')
        assert err.value.models == ('draft',)


def test_flags_come_back_when_traced(models):
    """Inside a caller's jit nothing can raise: the flags are in the returned stats."""
    fn, _ = samplers(models)['autoregressive_sample']
    args = fn.place((split(models['nan_target'])[1], PROMPTS, LENGTHS, 7))
    out = jax.jit(fn.core)(*args)
    assert bool(out.stats['nonfinite_target']) and not bool(out.stats['nonfinite_draft'])
    with pytest.raises(NonFiniteLogitsError, match='autoregressive_sample: the target'):
        fn.checked(out)


@pytest.mark.parametrize('bad', [10000, -7])
def test_out_of_range_prompt_id_refused_before_compiling(models, bad):
    prompts = PROMPTS.copy()
    prompts[2, 1] = bad
    # max_new 5: programs of their own, so an unbuilt jit shows nothing was compiled.
    for name, (fn, uses) in samplers(models, max_new=5).items():
        who = 'model' if name == 'autoregressive_sample' else 'target'
        match = rf'prompts\[2, 1\]={bad} is outside the vocabulary \[0, vocab_size=64\) of the '
        with pytest.raises(ValueError, match=match + f'{name} {who}'):
            call(fn, uses, models, prompts=prompts)
        assert fn._jitted is None, name


@pytest.mark.parametrize('bad', [10000, -7])
def test_padding_past_lengths_cannot_reach_the_models(models, bad):
    """Padding is not refused, and garbage there gives the tokens of zero padding."""
    padded = PROMPTS.copy()
    padded[1, 2:] = bad  # past row 1's length 2
    for name, (fn, uses) in samplers(models).items():
        want, got = call(fn, uses, models), call(fn, uses, models, prompts=padded)
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=name)


@pytest.mark.parametrize('sampling', [T1, SamplingConfig(0.0)])
def test_tree_rank_beyond_vocab_refused(models, sampling):
    tgd, dgd = split(models['target'])[0], split(models['draft'])[0]
    with pytest.raises(ValueError, match=r'tree path \(0, 69\): child rank 69 >= vocab_size=64'):
        make_tree_speculative_fn(
            tgd, dgd, tree=((0,), (0, 0), (0, 69)), max_new_tokens=MAX_NEW, sampling=sampling
        )


def test_draft_vocab_id_out_of_range_names_position(models):
    tgd, dgd = split(models['target'])[0], split(models['draft'])[0]
    with pytest.raises(ValueError, match=r'draft_vocab_ids\[2\]=64: ids must lie in \[0, target'):
        make_speculative_fn(
            tgd, dgd, num_draft_tokens=K, max_new_tokens=MAX_NEW, sampling=T1,
            draft_vocab_ids=[0, 5, 64, 3],
        )  # fmt: skip


def test_finite_models_pass_and_check_is_bit_identical(models):
    on, off = samplers(models), samplers(models, check_finite=False)
    for name, (fn, uses) in on.items():
        a = call(fn, uses, models)
        b = call(off[name][0], uses, models)
        np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=name)
        np.testing.assert_array_equal(a.lengths, b.lengths, err_msg=name)
        assert set(a.stats) == set(b.stats)
        for stat in a.stats:
            np.testing.assert_array_equal(a.stats[stat], b.stats[stat], err_msg=f'{name} {stat}')
        assert not a.stats['nonfinite_target'] and not a.stats['nonfinite_draft']
        assert (np.asarray(a.lengths) >= 1).all()
