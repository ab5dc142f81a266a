"""scan_layers: the stacked block layout equals the unstacked one (forward, cached decode,
gradients, samplers), converts bit exactly both ways, shards with a 'layers' axis and loads
across layouts from checkpoints."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sampling_models import (
    GREEDY_MAX_NEW,
    GREEDY_PROMPTS,
    make_model,
    perturbed,
    ragged_prompts,
    tiny_config,
)

from specjax.models import (
    Transformer,
    TransformerConfig,
    apply,
    apply_cached,
    init_cache,
    split,
)
from specjax.models import layout as lay

CFG = TransformerConfig(
    vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, max_len=64,
    tie_embeddings=False,
)  # fmt: skip
SCFG = dataclasses.replace(CFG, scan_layers=True)
_apply = jax.jit(apply, static_argnums=0)
_cached = jax.jit(apply_cached, static_argnums=0)


@pytest.fixture(scope='module')
def pair():
    """(unstacked model, stacked model) with the same parameters."""
    return Transformer(CFG, rngs=nnx.Rngs(0)), Transformer(SCFG, rngs=nnx.Rngs(0))


def _tokens(b, t, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size, dtype=jnp.int32)


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert type(x) is type(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_config_field_and_old_dicts():
    assert 'scan_layers' not in CFG.to_dict()  # old configs' dicts (and hashes) unchanged
    assert SCFG.to_dict()['scan_layers'] is True
    assert TransformerConfig.from_dict(SCFG.to_dict()) == SCFG
    assert TransformerConfig.from_dict(CFG.to_dict()) == CFG
    with pytest.raises(ValueError, match="scan_layers must be a bool, got 'yes'"):
        dataclasses.replace(CFG, scan_layers='yes')


def test_same_seed_gives_stacked_params_with_layers_axis(pair):
    model, scanned = pair
    _assert_trees_equal(lay.stack_layers(nnx.state(model)), nnx.state(scanned))
    q = scanned.blocks.attn.q
    assert q.shape == (3, 32, 4, 8)
    assert q.get_metadata()['out_sharding'] == ('layers', 'embed', 'heads', 'head_dim')
    assert lay.is_stacked(nnx.state(scanned)) and not lay.is_stacked(nnx.state(model))
    assert lay.num_layers(nnx.state(scanned)) == lay.num_layers(nnx.state(model)) == 3


def test_round_trips_are_bit_exact_for_states_and_pure_dicts(pair):
    model, _ = pair
    state = nnx.state(model)
    _assert_trees_equal(lay.unstack_layers(lay.stack_layers(state)), state)
    pure = jax.tree.map(np.asarray, state.to_pure_dict())
    stacked = lay.stack_layers(pure)
    assert isinstance(stacked['blocks']['mlp']['down'], np.ndarray)  # numpy stays numpy
    assert stacked['blocks']['mlp']['down'].shape == (3, 64, 32)
    _assert_trees_equal(lay.unstack_layers(stacked), pure)
    assert lay.convert_params(pure, False) is pure
    with pytest.raises(ValueError, match='already stacked'):
        lay.stack_layers(stacked)
    with pytest.raises(ValueError, match='already unstacked'):
        lay.unstack_layers(pure)
    with pytest.raises(ValueError, match=r'block indices \[0, 2\]'):
        lay.stack_layers({'blocks': {0: pure['blocks'][0], 2: pure['blocks'][2]}})


def test_forward_and_cached_decode_match_token_by_token(pair, highest_precision):
    (gd, params), (sgd, sparams) = split(pair[0]), split(pair[1])
    tokens = _tokens(2, 12)
    segments = jnp.asarray([[1] * 5 + [2] * 7, [1] * 12])  # causal and block-diagonal
    ref = _apply(gd, params, tokens, None, segments)
    np.testing.assert_allclose(_apply(sgd, sparams, tokens, None, segments), ref, atol=1e-6)
    # Every cached call passes positions and mask (as token trees do; here the defaults), so
    # the 8-token prefill and the tree call below share one compile per layout.
    models = [(gd, params), (sgd, sparams)]

    def call(caches, toks, num_valid, mask=None):
        c = caches[0]
        positions = c.lengths[:, None] + jnp.arange(toks.shape[1])[None]
        if mask is None:
            mask = jnp.arange(c.capacity)[None, None] <= positions[:, :, None]
        out = [_cached(*m, toks, num_valid, c, positions, mask) for m, c in zip(models, caches)]
        np.testing.assert_allclose(out[1][0], out[0][0], atol=1e-6)
        return [c for _, c in out]

    lengths = np.array([8, 5])  # ragged prefill, then one token per step from each length
    caches = call([init_cache(CFG, 2, 24), init_cache(SCFG, 2, 24)], tokens[:, :8], lengths)
    for t in range(3):
        step = tokens[np.arange(2), lengths + t][:, None]
        caches = call(caches, step, jnp.ones(2, jnp.int32))
    # the scanned model's cache is stacked [n_layers, ...] and holds the per-layer cache
    assert caches[1].stacked and caches[1].k.shape[0] == 3 and not caches[0].stacked
    np.testing.assert_allclose(caches[1].k, np.stack(caches[0].k), atol=1e-6)
    np.testing.assert_allclose(caches[1].v, np.stack(caches[0].v), atol=1e-6)
    np.testing.assert_array_equal(caches[1].lengths, caches[0].lengths)
    # An ancestor-only mask: node 2 does not see node 1 (its sibling).
    cap, base = 24, caches[0].lengths
    mask = jnp.arange(cap)[None, None] <= (base[:, None, None] + jnp.arange(8)[:, None])
    mask = mask.at[:, 2, base + 1].set(False)
    call(caches, tokens[:, 4:], jnp.zeros(2, jnp.int32), mask)


def test_gradients_match(pair, highest_precision):
    tokens = _tokens(2, 10, seed=1)

    def loss(graphdef, params):
        logits = apply(graphdef, params, tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    grad = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)
    g = grad(*split(pair[0]))
    sg = grad(*split(pair[1]))
    ref = lay.stack_layers(g)
    assert jax.tree.structure(ref) == jax.tree.structure(sg)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(sg), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-7, rtol=1e-5)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(sg['blocks'])) > 1e-4


def test_weight_decay_mask_ignores_the_layer_axis(pair):
    from specjax.train.optimizer import decay_mask

    flat = decay_mask(nnx.state(pair[0]))
    stacked = decay_mask(nnx.state(pair[1]))
    block = jax.tree.leaves(flat['blocks'][0])
    assert jax.tree.leaves(stacked['blocks']) == block and any(block) and not all(block)
    rest = lambda m: jax.tree.leaves({k: v for k, v in m.items() if k != 'blocks'})
    assert rest(stacked) == rest(flat)
    nested = decay_mask({'draft': nnx.state(pair[1])})  # co-training nests models
    assert jax.tree.leaves(nested['draft']['blocks']) == block


def test_shardings_map_the_layers_axis(pair):
    from jax.sharding import PartitionSpec as P

    from specjax.parallel import DEFAULT_RULES, default_mesh_config, make_mesh, param_shardings
    from specjax.parallel.sharding import logical_to_spec

    assert logical_to_spec(('layers', 'embed', 'mlp'), DEFAULT_RULES) == P(None, 'fsdp', 'tensor')
    rules = (*DEFAULT_RULES, ('layers', 'data'))  # an explicit rule wins over the default
    assert logical_to_spec(('layers', 'embed'), rules) == P('data', 'fsdp')
    mesh = make_mesh(default_mesh_config(), jax.devices()[:1])
    shardings = param_shardings(mesh, nnx.state(pair[1]), DEFAULT_RULES)
    assert shardings['blocks']['mlp']['gate'].get_value().spec == P(None, 'fsdp', 'tensor')


def test_tree_sampler_gives_the_same_tokens():
    """Greedy tree speculative decoding (tree-masked verification, per-row cache compaction)
    with a stacked target and draft emits exactly the unstacked pair's tokens."""
    from specjax.sampling import SamplingConfig, tree_speculative_sample

    target = make_model(tiny_config(vocab_size=17, max_len=48, n_layers=2), seed=3, scale=30.0)
    draft = perturbed(target, seed=4, noise=0.6)  # as sampling_models.greedy_models, 2 layers
    s_target, s_draft = lay.to_layout(target, True), lay.to_layout(draft, True)
    assert type(s_target) is type(target) and s_target.config.scan_layers
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, 4)
    kw = dict(max_new_tokens=GREEDY_MAX_NEW, sampling=SamplingConfig(0.0), rng=0)
    tree = ((0,), (1,), (0, 0), (0, 1))
    ref = tree_speculative_sample(target, draft, prompts, lengths, tree=tree, **kw)
    got = tree_speculative_sample(s_target, s_draft, prompts, lengths, tree=tree, **kw)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    assert int(ref.stats['rounds']) < len(lengths) * GREEDY_MAX_NEW  # drafts were accepted


def test_checkpoints_load_into_either_layout(pair, tmp_path):
    from specjax.checkpoint import Checkpoints, load_model
    from specjax.models.early_exit import early_exit_draft

    for model, name in ((pair[0], 'flat'), (pair[1], 'stacked')):
        ckpts = Checkpoints(tmp_path / name, async_save=False)
        meta = {'model_config': model.config.to_dict()}
        ckpts.save(1, {'params': split(model)[1]}, data_state={}, metadata=meta)
        ckpts.close()
    want = {False: nnx.state(pair[0]), True: nnx.state(pair[1])}
    for name in ('flat', 'stacked'):
        for scan in (None, False, True):
            model, meta = load_model(str(tmp_path / name), scan_layers=scan)
            layout = (name == 'stacked') if scan is None else scan
            assert model.config.scan_layers is layout
            _assert_trees_equal(nnx.state(model), want[layout])
    with pytest.raises(ValueError, match="scan_layers must be None or a bool, got 'no'"):
        load_model(str(tmp_path / 'flat'), scan_layers='no')
    # Early-exit drafts keep their source's layout and its first blocks.
    draft = early_exit_draft(pair[1], 2)
    assert draft.config.scan_layers and draft.blocks.attn.q.shape[0] == 2
    flat_draft = early_exit_draft(pair[0], 2)
    _assert_trees_equal(nnx.state(draft), lay.stack_layers(nnx.state(flat_draft)))


def test_scanned_model_refuses_a_per_layer_cache(pair):
    sgd, sparams = split(pair[1])
    with pytest.raises(ValueError, match='stacked KV cache'):
        _cached(sgd, sparams, _tokens(2, 3), jnp.ones(2, jnp.int32), init_cache(CFG, 2, 24))
