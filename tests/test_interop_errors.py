"""Truncated or malformed model files and configs fail naming the file (and tensor, and key);
a failed import leaves nothing new behind and an existing workdir untouched."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf_fixtures import write_tiny_gguf
from safetensors.numpy import save_file

from specjax.errors import USER_ERROR_EXIT_CODE
from specjax.interop import hf_config_from
from specjax.interop.convert import tensor_specs
from specjax.interop.errors import CorruptModelFileError
from specjax.interop.gguf import import_gguf
from specjax.interop.hf import import_llama
from specjax.interop.integrity import check_gguf, check_safetensors
from specjax.interop.staging import staged
from specjax.interop.workdir import early_exit_workdir, import_workdir
from specjax.models import TransformerConfig

CORRUPT = 'truncated or corrupt'


@pytest.fixture(scope='module')
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(str(tmp_path_factory.mktemp('gguf') / 'tiny.gguf'))


def _cut(src, dst, n: int) -> str:
    with open(src, 'rb') as f:
        data = f.read()
    with open(dst, 'wb') as f:
        f.write(data[:n])
    return str(dst)


def _patched(src, dst, at: int, new: bytes) -> str:
    data = bytearray(open(src, 'rb').read())
    data[at : at + len(new)] = new
    open(dst, 'wb').write(bytes(data))
    return str(dst)


# --- GGUF ---------------------------------------------------------------------------------------


def test_intact_gguf_ranges_lie_inside_the_file(tiny_gguf):
    ranges = check_gguf(tiny_gguf)
    size = os.path.getsize(tiny_gguf)
    assert len(ranges) == 1 + 3 * 9 + 2  # embed, 3 layers x 9, final norm, untied head
    assert all(0 < start < end <= size for start, end in ranges.values())
    assert max(end for _, end in ranges.values()) == size
    reader = gguf.GGUFReader(tiny_gguf)  # the same ranges as the gguf package's own reader
    assert ranges == {t.name: (t.data_offset, t.data_offset + t.n_bytes) for t in reader.tensors}


@pytest.mark.parametrize('where', ['empty', 'magic', 'counts', 'metadata', 'tensor_infos'])
def test_gguf_cut_inside_the_header_names_the_file(tiny_gguf, tmp_path, where):
    first_data = min(start for start, _ in check_gguf(tiny_gguf).values())
    n = {'empty': 0, 'magic': 2, 'counts': 12, 'metadata': 200, 'tensor_infos': first_data - 40}
    path = _cut(tiny_gguf, tmp_path / f'{where}.gguf', n[where])
    with pytest.raises(CorruptModelFileError) as info:
        import_gguf(path)
    message = str(info.value)
    assert path in message and CORRUPT in message, message
    inside = {'empty': 'the GGUF magic', 'magic': 'the GGUF magic', 'counts': 'the tensor count',
              'metadata': 'metadata', 'tensor_infos': "tensor '"}  # fmt: skip
    assert re.search(f'the header ends inside [^:]*{inside[where]}', message), message


@pytest.mark.parametrize('which', ['first', 'middle', 'last'])
def test_gguf_cut_inside_tensor_data_names_the_tensor_and_bytes(tiny_gguf, tmp_path, which):
    ranges = sorted(check_gguf(tiny_gguf).items(), key=lambda kv: kv[1])
    name, (start, end) = {'first': ranges[0], 'middle': ranges[12], 'last': ranges[-1]}[which]
    cut = start + (end - start) // 2
    path = _cut(tiny_gguf, tmp_path / f'{which}.gguf', cut)
    with pytest.raises(CorruptModelFileError) as info:
        import_gguf(path)
    message = str(info.value)
    assert info.value.tensor == name and info.value.path == path
    assert path in message and repr(name) in message and CORRUPT in message, message
    assert f'needs {end - start} bytes at offset {start}' in message, message
    assert f'the file has {cut} bytes ({cut - start} of them available)' in message, message
    past = sum(e > cut for _, (_, e) in ranges)
    assert (f'; {past} tensors end past the end of the file' in message) == (past > 1), message


def test_gguf_malformed_headers_are_refused(tiny_gguf, tmp_path):
    not_gguf = tmp_path / 'not.gguf'
    not_gguf.write_bytes(b'PK\x03\x04' + bytes(100))
    with pytest.raises(CorruptModelFileError, match=r"starts with b'PK.*truncated or corrupt"):
        import_gguf(str(not_gguf))
    huge_count = _patched(tiny_gguf, tmp_path / 'count.gguf', 8, struct.pack('<Q', 2**40))
    with pytest.raises(CorruptModelFileError, match=r'claims 1099511627776 tensors'):
        import_gguf(huge_count)
    # The first metadata key's length (at byte 24) made larger than the file.
    long_key = _patched(tiny_gguf, tmp_path / 'key.gguf', 24, struct.pack('<Q', 2**33))
    with pytest.raises(
        CorruptModelFileError, match=r'inside metadata key #0.*truncated or corrupt'
    ):
        import_gguf(long_key)


# --- safetensors and config.json ----------------------------------------------------------------

_CFG = TransformerConfig(
    vocab_size=40, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24, max_len=32
)


def _hf_dir(path):
    rng = np.random.default_rng(0)
    path.mkdir()
    (path / 'config.json').write_text(json.dumps(hf_config_from(_CFG)))
    tensors = {s.name: rng.normal(0, 0.3, s.shape).astype(np.float32) for s in tensor_specs(_CFG)}
    save_file(tensors, path / 'model.safetensors', metadata={'format': 'pt'})
    return path


def test_intact_hf_dir_imports(tmp_path):
    assert import_llama(_hf_dir(tmp_path / 'ok')).config.d_ff == 24


@pytest.mark.parametrize('where', ['length', 'header', 'data'])
def test_truncated_safetensors_names_file_and_tensor(tmp_path, where):
    directory = _hf_dir(tmp_path / where)
    weights = directory / 'model.safetensors'
    ranges = check_safetensors(str(weights))
    name, (start, end) = max(ranges.items(), key=lambda kv: kv[1])
    n = {'length': 5, 'header': 30, 'data': end - 3}[where]
    _cut(weights, weights, n)
    with pytest.raises(CorruptModelFileError) as info:
        import_llama(directory)
    message = str(info.value)
    assert str(weights) in message and CORRUPT in message, message
    if where == 'data':
        assert info.value.tensor == name and repr(name) in message
        assert f'needs {end - start} bytes at offset {start}' in message, message


def test_malformed_safetensors_headers_name_the_file(tmp_path):
    directory = _hf_dir(tmp_path / 'json')
    weights = directory / 'model.safetensors'
    _patched(weights, weights, 8, b'#')  # the header's opening brace
    with pytest.raises(CorruptModelFileError, match=r'not valid JSON.*truncated or corrupt'):
        import_llama(directory)
    # A header that parses and fits the file but that safetensors itself refuses (a hole between
    # tensors): its SafetensorError is wrapped naming the file.
    hole = _hf_dir(tmp_path / 'hole')
    header = json.dumps({'a': {'dtype': 'F32', 'shape': [1], 'data_offsets': [4, 8]}}).encode()
    (hole / 'model.safetensors').write_bytes(struct.pack('<Q', len(header)) + header + bytes(8))
    with pytest.raises(CorruptModelFileError, match=r'safetensors cannot open it') as info:
        import_llama(hole)
    assert str(hole / 'model.safetensors') in str(info.value)
    wrong_size = _hf_dir(tmp_path / 'size')
    header = json.dumps({'a': {'dtype': 'F32', 'shape': [3], 'data_offsets': [0, 8]}}).encode()
    (wrong_size / 'model.safetensors').write_bytes(
        struct.pack('<Q', len(header)) + header + b'0' * 8
    )
    with pytest.raises(CorruptModelFileError, match=r"tensor 'a': data_offsets \[0, 8\] do not"):
        import_llama(wrong_size)


def test_config_json_missing_key_or_invalid_names_key_and_path(tmp_path):
    directory = _hf_dir(tmp_path / 'nokey')
    config = directory / 'config.json'
    hf = json.loads(config.read_text())
    del hf['intermediate_size']
    config.write_text(json.dumps(hf))
    with pytest.raises(ValueError) as info:
        import_llama(directory)
    assert str(info.value) == f'config.json at {config} lacks required key intermediate_size'
    config.write_text(json.dumps(hf)[:-5])
    with pytest.raises(CorruptModelFileError) as info:
        import_llama(directory)
    assert str(config) in str(info.value) and 'not valid JSON' in str(info.value)
    index = directory / 'model.safetensors.index.json'
    index.write_text('{"weight_map": ')
    config.write_text(json.dumps(hf_config_from(_CFG)))
    with pytest.raises(CorruptModelFileError, match='index.json: it is not valid JSON'):
        import_llama(directory)


# --- nothing half-made is left behind -----------------------------------------------------------


def _tree(root) -> dict[str, bytes | None]:
    out = {}
    for parent, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.join(parent, d)] = None
        for f in files:
            out[os.path.join(parent, f)] = open(os.path.join(parent, f), 'rb').read()
    return out


def test_nan_weights_are_refused_naming_file_and_tensor(tiny_gguf, tmp_path):
    start, _ = check_gguf(tiny_gguf)['output_norm.weight']  # float32
    nan = _patched(tiny_gguf, tmp_path / 'nan.gguf', start, np.float32(np.nan).tobytes())
    with pytest.raises(CorruptModelFileError, match=r"'output_norm.weight': 1 of its 64 values"):
        import_gguf(nan)
    directory = _hf_dir(tmp_path / 'hf')
    weights = directory / 'model.safetensors'
    start, _ = check_safetensors(str(weights))['model.norm.weight']
    _patched(weights, weights, start + 4, np.float32(np.inf).tobytes())
    with pytest.raises(CorruptModelFileError, match=r"'model.norm.weight': 1 of its 16 values"):
        import_llama(directory)


@contextlib.contextmanager
def _disk_full_at_tokenizer(monkeypatch):
    """The write's last step (the tokenizer files, after the checkpoint) fails: disk full.
    Yields the listings of the directories it was asked to write into."""
    from specjax.data.hf_tokenizer import HuggingFaceTokenizer

    seen = []

    def save(self, directory):
        seen.append(sorted(os.listdir(directory)))
        open(os.path.join(directory, 'tokenizer.json'), 'w').write('{"half": ')
        raise OSError(errno.ENOSPC, 'No space left on device')

    with monkeypatch.context() as patch:
        patch.setattr(HuggingFaceTokenizer, 'save', save)
        yield seen


@pytest.fixture
def disk_full_at_tokenizer(monkeypatch):
    with _disk_full_at_tokenizer(monkeypatch) as seen:
        yield seen


def test_failed_import_into_a_new_workdir_leaves_nothing(
    tmp_path, tiny_gguf, disk_full_at_tokenizer
):
    truncated = _cut(tiny_gguf, tmp_path / 'cut.gguf', os.path.getsize(tiny_gguf) - 10)
    with pytest.raises(CorruptModelFileError):
        import_workdir(f'gguf:{truncated}', str(tmp_path / 'a'))
    with pytest.raises(OSError, match='No space left'):
        import_workdir(f'gguf:{tiny_gguf}', str(tmp_path / 'b' / 'c' / 'wd'))
    assert disk_full_at_tokenizer == [['checkpoints']]  # it failed after the checkpoint
    assert sorted(os.listdir(tmp_path)) == ['cut.gguf']  # no a/, no b/, no .partial sibling


def test_failed_import_leaves_an_existing_workdir_untouched(
    tmp_path, tiny_gguf, disk_full_at_tokenizer
):
    existing = tmp_path / 'existing'
    existing.mkdir()
    (existing / 'notes.txt').write_text('mine')
    with pytest.raises(OSError, match='No space left'):
        import_workdir(f'gguf:{tiny_gguf}', str(existing))
    assert disk_full_at_tokenizer == [['checkpoints', 'notes.txt']]
    assert _tree(existing) == {str(existing / 'notes.txt'): b'mine'}  # nothing new is left


def test_refused_import_or_failed_early_exit_leave_workdirs_untouched(
    tmp_path, tiny_gguf, monkeypatch
):
    existing = tmp_path / 'existing'
    import_workdir(f'gguf:{tiny_gguf}', str(existing))
    before = _tree(existing)
    assert str(existing / 'checkpoints') in before and str(existing / 'tokenizer.json') in before
    with pytest.raises(ValueError, match='already holds checkpoints'):
        import_workdir(f'gguf:{tiny_gguf}', str(existing))
    assert _tree(existing) == before
    with _disk_full_at_tokenizer(monkeypatch) as seen:
        with pytest.raises(OSError, match='No space left'):
            early_exit_workdir(str(existing), str(tmp_path / 'draft'), 1)
    assert seen == [['checkpoints']]
    assert _tree(existing) == before
    assert sorted(os.listdir(tmp_path)) == ['existing']


def test_cli_refuses_a_truncated_file_in_one_line_naming_it(tmp_path, tiny_gguf):
    truncated = _cut(tiny_gguf, tmp_path / 'cut.gguf', 1000)
    workdir = tmp_path / 'wd'
    run = subprocess.run(
        [sys.executable, '-m', 'specjax.interop', 'import', f'--source=gguf:{truncated}',
         f'--workdir={workdir}'],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS='cpu'),
    )  # fmt: skip
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == USER_ERROR_EXIT_CODE, run.stderr[-2000:]
    assert last.startswith('FATAL ') and truncated in last and CORRUPT in last, last
    assert 'Traceback' not in run.stderr  # a refusal is one line
    assert sorted(os.listdir(tmp_path)) == ['cut.gguf']


def test_staged_renames_on_success_and_removes_on_failure(tmp_path):
    with pytest.raises(KeyboardInterrupt), staged(str(tmp_path / 'x' / 'wd')) as into:
        open(os.path.join(into, 'half'), 'w').close()
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []
    with staged(str(tmp_path / 'wd')) as into:
        assert into != str(tmp_path / 'wd')
        open(os.path.join(into, 'whole'), 'w').close()
    assert os.listdir(tmp_path) == ['wd'] and os.listdir(tmp_path / 'wd') == ['whole']
    mode = os.stat(tmp_path / 'wd').st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o777 & ~umask
