"""specjax.config_files: parse_arg's spellings and errors, load_config's 'path.py[:arg]' as
--config= loads it, and overrides with --config.a.b=v semantics (checked against config_flags)."""

from __future__ import annotations

import pathlib
import textwrap

import ml_collections
import pytest

from specjax.config_files import join_spec, load_config, one_of, parse_arg, split_spec

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / 'configs'

_SPEC = dict(size=one_of('full', ('full', 'tiny')), model=one_of('embedded', ('embedded', 'x')))


# ----------------------------------------------------------------------------- parse_arg


@pytest.mark.parametrize(
    'arg, size, model',
    [
        (None, 'full', 'embedded'),
        ('', 'full', 'embedded'),
        ('size=tiny', 'tiny', 'embedded'),
        ('tiny', 'tiny', 'embedded'),  # a bare value is the first option's
        ('model=x', 'full', 'x'),
        ('model=x,size=tiny', 'tiny', 'x'),
        ('size=tiny,model=x', 'tiny', 'x'),
        ('tiny,model=x', 'tiny', 'x'),
        ('size=tiny,', 'tiny', 'embedded'),  # empty items are skipped
        (' size=tiny , model=x ', 'tiny', 'x'),
        ('size=tiny,size=full', 'full', 'embedded'),  # the last value wins
    ],
)
def test_parse_arg_spellings(arg, size, model):
    opts = parse_arg(arg, **_SPEC)
    assert isinstance(opts, ml_collections.ConfigDict)
    assert (opts.size, opts.model) == (size, model)


def test_parse_arg_types_come_from_the_defaults():
    spec = dict(name='a', steps=10, lr=1e-3, fast=False, draft='')
    assert parse_arg(None, **spec).to_dict() == spec
    opts = parse_arg('steps=20,lr=3e-3,fast=true,draft=tiny,name=b', **spec)
    assert opts.to_dict() == dict(name='b', steps=20, lr=3e-3, fast=True, draft='tiny')
    assert type(opts.steps) is int and type(opts.lr) is float and opts.fast is True
    for text, value in [('True', True), ('1', True), ('yes', True), ('false', False), ('0', False)]:
        assert parse_arg(f'fast={text}', **spec).fast is value
    assert parse_arg('fast', **spec).fast is True  # a bare bool option's name sets it
    assert parse_arg('c', **spec).name == 'c'  # any other bare item: the first option
    assert parse_arg('lr=1', **spec).lr == 1.0 and type(parse_arg('lr=1', **spec).lr) is float
    assert parse_arg('draft=', **spec).draft == ''


@pytest.mark.parametrize(
    'arg, match',
    [
        ('foo=1', r"config argument 'foo=1': unknown option 'foo'"),
        ('size=huge', r"config argument 'size=huge': size='huge' is not one of full\|tiny"),
        ('huge', r"config argument 'huge': size='huge' is not one of full\|tiny"),
        ('size=tiny,model=y', r"'size=tiny,model=y': model='y' is not one of embedded\|x"),
        ('steps=ten', r"config argument 'steps=ten': steps='ten' is not an int"),
        ('lr=fast', r"config argument 'lr=fast': lr='fast' is not a float"),
        ('fast=maybe', r"config argument 'fast=maybe': fast='maybe' is not a bool"),
        ('size=', r"config argument 'size=': size='' is not one of"),
    ],
)
def test_parse_arg_errors_name_the_argument_and_the_spelling(arg, match):
    spec = dict(_SPEC, steps=1, lr=0.1, fast=False)
    with pytest.raises(ValueError, match=match) as e:
        parse_arg(arg, **spec)
    assert 'expected comma-separated size=full|tiny, model=embedded|x, steps=<int' in str(e.value)


def test_one_of_checks_its_default_and_takes_a_mapping():
    assert parse_arg('b', size=one_of('a', {'a': 1, 'b': 2})).size == 'b'
    with pytest.raises(ValueError, match="default 'c' is not among"):
        one_of('c', ('a', 'b'))
    with pytest.raises(TypeError, match='at least one option'):
        parse_arg('x')


# ----------------------------------------------------------------------------- load_config

_CONFIG_FILE = """
import ml_collections
from specjax.config_files import one_of, parse_arg

CALLS = []

def get_config(*args):
    CALLS.append(args)
    opts = parse_arg(args[0] if args else None, size=one_of('small', ('small', 'tiny')), n=3)
    c = ml_collections.ConfigDict()
    c.args = repr(args)  # what get_config was called with
    c.size = opts.size
    c.seed = 0
    c.lr = 1e-3
    c.flag = False
    c.name = 'x'
    c.ks = (1, 2)
    c.train = ml_collections.ConfigDict({'steps': 10 * opts.n, 'batch': 8})
    c.data = ml_collections.ConfigDict({'vocab_size': 256})
    c.model = ml_collections.ConfigDict({'vocab_size': c.data.get_ref('vocab_size')})
    return c
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / 'my_config.py'
    path.write_text(textwrap.dedent(_CONFIG_FILE))
    return str(path)


def _config_flags(spec: str, *flag_args: str) -> ml_collections.ConfigDict:
    """What `--config=spec --config.a.b=v ...` gives (ml_collections' own parsing)."""
    from absl import flags
    from ml_collections import config_flags

    fv, argv = flags.FlagValues(), ['prog', f'--config={spec}', *flag_args]
    config_flags.DEFINE_config_file('config', None, 'config', flag_values=fv, sys_argv=argv)
    fv(argv)
    return fv.config


def test_split_and_join_spec_round_trip():
    assert split_spec('configs/x.py:size=tiny,a=b:c') == ('configs/x.py', 'size=tiny,a=b:c')
    assert split_spec('configs/x.py') == ('configs/x.py', None)
    assert split_spec('configs/x.py:') == ('configs/x.py', '')
    for spec in ('configs/x.py:size=tiny', 'configs/x.py', 'configs/x.py:'):
        assert join_spec(*split_spec(spec)) == spec
    assert join_spec(pathlib.Path('a/b.py'), 'k=v') == 'a/b.py:k=v'
    with pytest.raises(ValueError, match='path.py'):
        split_spec('')


@pytest.mark.parametrize('arg', [None, '', 'size=tiny', 'tiny', 'n=5,size=tiny'])
def test_file_arg_round_trip_matches_config_flags(config_file, arg):
    spec = join_spec(config_file, arg)
    config = load_config(spec)
    assert config.args == ('()' if arg is None else repr((arg,)))  # no ':': get_config()
    assert config.to_dict() == _config_flags(spec).to_dict()


def test_load_config_runs_the_file_afresh_and_checks_it(config_file, tmp_path):
    a, b = load_config(config_file), load_config(config_file)
    assert a is not b and a.to_dict() == b.to_dict()
    a.train.steps = 1
    assert load_config(config_file).train.steps == 30  # nothing cached between loads
    with pytest.raises(ValueError, match=r"Config file '.*missing\.py' does not exist"):
        load_config(str(tmp_path / 'missing.py:size=tiny'))
    bad = tmp_path / 'bad.py'
    bad.write_text('def get_config(arg=None):\n    return {"a": 1}\n')
    with pytest.raises(ValueError, match=r'bad\.py: get_config\(\) returned dict'):
        load_config(str(bad))
    with pytest.raises(ValueError, match="config argument 'size=huge'"):
        load_config(f'{config_file}:size=huge')


# (override as load_config takes it, the same as a --config flag): string values parse by the
# field's type as the flag would; a linked field (FieldReference) updates what refers to it.
_OVERRIDES = [
    (('train.steps', '5'), '--config.train.steps=5'),
    (('lr', '0.5'), '--config.lr=0.5'),
    (('flag', 'true'), '--config.flag=true'),
    (('ks', '(3,4,5)'), '--config.ks=(3,4,5)'),
    (('name', 'hello'), '--config.name=hello'),
    (('data.vocab_size', '512'), '--config.data.vocab_size=512'),
    (('ks', '(7,)'), '--config.ks=(7,)'),
]


@pytest.mark.parametrize('override, flag', _OVERRIDES, ids=[f for _, f in _OVERRIDES])
def test_string_overrides_match_config_flags(config_file, override, flag):
    spec = f'{config_file}:size=tiny'
    got = load_config(spec, [override])
    assert got.to_dict() == _config_flags(spec, flag).to_dict()


def test_value_overrides_and_their_semantics(config_file):
    c = load_config(
        config_file,
        [('train.steps', 7), ('lr', 1), ('ks', [3, 4]), ('data.vocab_size', 64), ('seed', 2)],
    )
    assert (c.train.steps, c.lr, c.ks, c.seed) == (7, 1.0, (3, 4), 2)
    assert type(c.lr) is float  # an int fits a float field
    assert c.model.vocab_size == 64  # linked to data.vocab_size, as --config.data.vocab_size=64
    d = load_config(config_file, {'train.batch': 4, 'train.steps': '9'})  # a mapping works too
    assert (d.train.batch, d.train.steps) == (4, 9)
    later = load_config(config_file, [('seed', 1), ('seed', 3)])  # applied in order
    assert later.seed == 3


@pytest.mark.parametrize(
    'override, match',
    [
        (('train.stepz', 1), r"field 'train.stepz' does not exist .*known in train: \['batch'"),
        (('nope.steps', 1), r"field 'nope.steps' does not exist"),
        (('train', 1), r"field 'train' is a section"),
        (('train.steps', 'ten'), r'override train.steps=.ten.'),
        (('train.steps', 1.5), r'override train.steps=1.5'),
        (('name', 3), r'override name=3'),
    ],
)
def test_bad_overrides_name_the_field(config_file, override, match):
    with pytest.raises(ValueError, match=match):
        load_config(config_file, [override])


# ----------------------------------------------------------------------------- the repo's configs


@pytest.mark.parametrize(
    'spec, same_as',
    [
        ('pretrain.py:tiny', 'pretrain.py:size=tiny'),
        ('pretrain.py:', 'pretrain.py:size=small'),
        ('pretrain.py', 'pretrain.py:size=small'),
        ('target.py:size=tiny', 'pretrain.py:size=tiny'),  # the alias, kept for one release
        ('target.py', 'pretrain.py'),
        ('smollm2.py', 'spec_eval_smollm2.py'),
        ('distill.py:test', 'distill.py:size=test'),
        ('cotrain.py:size=small,draft=small', 'cotrain.py:draft=small,size=small'),
        ('spec_eval.py:preset=checkpoints', 'spec_eval.py:checkpoints'),
        ('spec_eval.py', 'spec_eval.py:random'),
        ('quickstart.py:tiny', 'quickstart.py:size=tiny'),
        ('quickstart.py', 'quickstart_smollm2.py:size=quick'),  # the main job: SmolLM2
        ('quickstart.py:preset=embedded', 'quickstart.py:preset=embedded,size=full'),
        ('quickstart.py:preset=smollm2,size=tiny', 'quickstart_smollm2.py:size=tiny'),
        ('quickstart.py:model=smollm2,size=tiny', 'quickstart_smollm2.py:size=tiny'),  # old name
        ('ablations/distillspec.py', 'ablations/distillspec.py:size=tiny'),
    ],
)
def test_repo_configs_load_with_every_spelling(spec, same_as):
    assert (
        load_config(str(CONFIGS / spec)).to_dict() == load_config(str(CONFIGS / same_as)).to_dict()
    )


def test_repo_config_with_overrides_matches_the_command_line():
    spec = str(CONFIGS / 'pretrain.py:size=tiny')
    got = load_config(spec, [('train.steps', '3'), ('data.vocab_size', 512)])
    want = _config_flags(spec, '--config.train.steps=3', '--config.data.vocab_size=512')
    assert got.to_dict() == want.to_dict()
    assert got.model.vocab_size == 512
