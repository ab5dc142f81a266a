"""SmolLM2-135M-Instruct (the bundled GGUF): specjax's import against transformers loading the
same file — logits, greedy continuations, token ids. transformers' load is slow (~60 s on a
shared CPU), so it happens once per module."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning')
torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

PROMPTS = [
    'The capital of France is',
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'Speculative decoding lets a small draft model propose tokens that a large model',
]
TEXTS = [
    'def f(x):\n    return x + 1\n\n\nclass A:\n\tpass\n',
    'Prose, with punctuation; quotes "like this" and it\'s fine — really.',
    'naïve café 日本語 🙂 Ω≈ç√ Straße',
    '   leading spaces\n\n\n\ttabs\t\t and   runs   of   spaces   ',
    'Year 2024: 3.14159 and 1,000,000 items',
    '<|im_start|>user\nhello<|im_end|>\n',
]
NEAR_TIE = (
    1e-2  # a greedy divergence is accepted only where transformers' top-2 logits are this close
)
# Logit tolerances against transformers, from the spread measured on a 2-core AMD EPYC: specjax
# float32 (uncached, scan_layers, jitted and batch-2 runs) vs transformers float64 and float32,
# over these PROMPTS plus 4 more (2..170 tokens, 316 positions in all).
LOGIT_TOL = 5e-3  # any logit: measured max 1.32e-3 (4x headroom); see the test's docstring
MEDIAN_TOL = 3e-4  # median over positions of each position's max diff: measured 3.9e-5 (8x)


@pytest.fixture(scope='module')
def path():
    from specjax.interop.workdir import bundled_path

    try:
        return bundled_path('smollm2-135m')
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope='module')
def ours(path):
    from specjax.interop.gguf import import_gguf

    return import_gguf(path)


@pytest.fixture(scope='module')
def theirs(path):
    folder, name = os.path.dirname(path), os.path.basename(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    return model.eval(), transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_logits_match_transformers(ours, theirs):
    """specjax float32 against transformers float64 (and float32) on the same GGUF weights.

    float32 rounding alone moves a logit (scale ~30) by up to ~1e-3 at an ill-conditioned
    position: position 1 of the 'Speculative decoding' prompt differs from transformers float64
    by 1.19e-3 (specjax uncached), 0.83e-3 (scan_layers), 1.32e-3 (jitted) and 0.74e-3
    (transformers' own float32 run); the uncached run's other positions over 7 measured prompts
    are within 2.3e-4 (median 3.9e-5, p90 5.7e-5). So the max is held to LOGIT_TOL = 5e-3
    (~4x the worst measured) and the bulk to MEDIAN_TOL = 3e-4 (~8x its measured 3.9e-5): a
    median does not hinge on one position's accumulation order, yet catches small real bugs
    (measured medians: 1.5e-3 with rope_theta off by 0.1%, 5.1e-3 with one layer's mlp.down
    rounded to bfloat16, 6.7e-3 with norm_eps doubled). The greedy token must agree at every
    position that is not a near tie. No float64 check: specjax has no float64 compute dtype,
    and transformers' float64 run still computes RoPE angles in float32 (a float64 specjax,
    patched for the measurement, was within 4.2e-5 of it)."""
    import copy

    model, tok = ours
    hf, _ = theirs
    hf64 = copy.deepcopy(hf).double()
    per_position = []
    for prompt in PROMPTS:
        ids = [tok.bos_id, *tok.encode(prompt)]
        a = np.asarray(model(jnp.asarray([ids], jnp.int32)))[0]
        with torch.no_grad():
            b = hf(torch.tensor([ids])).logits.numpy()[0]
            c = hf64(torch.tensor([ids])).logits.numpy()[0]
        err = np.abs(a - c).max(-1)  # [T]: each position's max |logit diff| vs float64
        per_position.append(err)
        print(
            f'max |specjax - transformers|: float32 {np.abs(a - b).max():.2e}, '
            f'float64 {err.max():.2e} (median {np.median(err):.2e}, {prompt[:20]!r})'
        )
        assert err.max() < LOGIT_TOL, (prompt, int(err.argmax()), float(err.max()))
        assert np.abs(a - b).max() < LOGIT_TOL, prompt
        top2 = np.sort(c, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > NEAR_TIE
        assert clear.any(), prompt
        bad = np.flatnonzero(clear & (a.argmax(-1) != c.argmax(-1)))
        assert bad.size == 0, (prompt, bad.tolist())
    median = float(np.median(np.concatenate(per_position)))
    print(f'median over positions of max |specjax - transformers float64|: {median:.2e}')
    assert median < MEDIAN_TOL, median


def test_greedy_continuations_match_transformers(ours, theirs):
    from specjax.sampling import SamplingConfig, autoregressive_sample

    model, tok = ours
    hf, _ = theirs
    n = 32
    rows = [tok.encode(p) for p in PROMPTS]
    width = max(map(len, rows))
    prompts = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        prompts[i, : len(r)] = r
    out = autoregressive_sample(
        model,
        jnp.asarray(prompts),
        jnp.asarray([len(r) for r in rows], jnp.int32),
        max_new_tokens=n,
        sampling=SamplingConfig(temperature=0.0),
        rng=jax.random.key(0),
    )
    mine = np.asarray(out.tokens)
    for i, r in enumerate(rows):
        with torch.no_grad():  # stops at eos (specjax runs on: compare up to there)
            gen = hf.generate(
                torch.tensor([r]), max_new_tokens=n, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=tok.pad_id,
            )  # fmt: skip
        ref = gen.sequences[0, len(r) :].numpy()
        diff = np.flatnonzero(mine[i, : len(ref)] != ref)
        if diff.size:  # allowed only after a near tie in transformers' own logits
            t = int(diff[0])
            top2 = np.sort(gen.logits[t][0].numpy())[-2:]
            gap = float(top2[1] - top2[0])
            print(f'prompt {i}: divergence at token {t} after a near tie (gap {gap:.2e})')
            assert gap < NEAR_TIE, (i, t, gap)
        else:
            print(f'prompt {i}: {len(ref)} greedy tokens identical')
        if i == 0:
            assert tok.decode(mine[i][:2]).strip().startswith('Paris')


def test_token_ids_match_transformers(ours, theirs):
    _, tok = ours
    _, hf_tok = theirs
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == text.replace('<|im_end|>', '').replace(
            '<|im_start|>', ''
        )
    messages = [
        {'role': 'system', 'content': 'Be brief.'},
        {'role': 'user', 'content': 'What is 2 + 2?'},
    ]
    text = tok.apply_chat_template(messages)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.vocab_size == len(hf_tok) == 49152
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)


def test_whitespace_before_digits_follows_llama_cpp(ours, theirs):
    """llama.cpp's 'smollm' pre-tokenizer splits digits off first (\\p{N}), then GPT-2's regex;
    transformers' GGUF tokenizer skips the digit split, so a run of spaces before a digit is
    cut differently there. specjax follows llama.cpp (and SmolLM's own tokenizer.json)."""
    _, tok = ours
    _, hf_tok = theirs
    ids = tok.encode('a  1')
    assert [tok.id_to_piece(i) for i in ids] == ['a', 'ĠĠ', '1']
    assert hf_tok.convert_ids_to_tokens(hf_tok.encode('a  1', add_special_tokens=False)) == [
        'a', 'Ġ', 'Ġ', '1',
    ]  # fmt: skip
