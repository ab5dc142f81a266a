"""grain input pipeline: shuffled, sharded, chunked and packed token rows with checkpointable state.

Train stream, per process: documents shuffled by (seed, epoch) -> this process's share of the
global order (global index % process_count == process_index; disjoint, covering) -> tokens
[bos] + ids + [eos] -> chunks of <= seq_len -> first-fit packed rows of seq_len -> batches of
global_batch_size / process_count -> forever. Batches are dicts of int32 [b, seq_len]:
tokens, segment_ids (1.. per chunk, 0 = pad), positions (0.. per chunk), domain_ids (-1 = pad).
"""

from __future__ import annotations

import io
import itertools

import grain
import numpy as np

from specjax.data import digests, sources
from specjax.data.tokenizers import Tokenizer

BATCH_KEYS = ('tokens', 'segment_ids', 'positions', 'domain_ids')


class TokenizedSplit:
    """A split's token ids (without bos/eos) as one flat array with offsets; a grain source."""

    def __init__(
        self, ids: np.ndarray, offsets: np.ndarray, domains: np.ndarray, bos: int, eos: int
    ):
        self.ids, self.offsets, self.domains = ids, offsets, domains
        self._bos, self._eos = bos, eos

    def __len__(self) -> int:
        return len(self.domains)

    def __getitem__(self, i: int) -> dict:
        a, b = self.offsets[i], self.offsets[i + 1]
        tokens = np.empty(b - a + 2, np.int32)
        tokens[0], tokens[-1] = self._bos, self._eos
        tokens[1:-1] = self.ids[a:b]
        return {'tokens': tokens, 'domain': int(self.domains[i]), 'doc': i}

    def num_tokens(self) -> int:
        """Tokens including each document's bos and eos."""
        return int(self.offsets[-1]) + 2 * len(self)


def _tokenize_split(reader: sources.SplitReader, tok: Tokenizer, chunk: int = 64) -> bytes:
    """Tokenizes a whole split; returns an .npz (ids, offsets, domains)."""
    ids, domains = [], []
    texts = []
    for text, domain in reader.read_all():
        texts.append(text)
        domains.append(domain)
        if len(texts) == chunk:
            ids.extend(tok.encode_batch(texts))
            texts = []
    ids.extend(tok.encode_batch(texts))
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    flat = np.concatenate(ids).astype(dtype) if ids else np.zeros(0, dtype)
    buf = io.BytesIO()
    np.savez(buf, ids=flat, offsets=offsets, domains=np.asarray(domains, np.int32))
    return buf.getvalue()


def tokenized_split(data_config, tok: Tokenizer, split: str) -> TokenizedSplit:
    """The split's token ids, cached beside the data keyed by the split's records digest and
    the tokenizer hash (see cache_tokens), so re-prepared records never meet stale tokens."""
    ds = sources.open_dataset(data_config)
    reader = sources.SplitReader(ds, split)
    tok_hash = tok.identity()['hash']
    records = digests.corpus_digest(ds)['splits'][split]['sha256'][:12]
    name = f'tokens_{split}_{ds.text_feature}_{ds.domain_feature}_{tok_hash}_r{records}.npz'
    blob = sources.cached_bytes(ds.cache_dir / name, lambda: _tokenize_split(reader, tok))
    with np.load(io.BytesIO(blob)) as z:
        return TokenizedSplit(z['ids'], z['offsets'], z['domains'], tok.bos_id, tok.eos_id)


class _OnTheFly:
    """Tokenizes documents as they are read (for corpora too large to cache)."""

    def __init__(self, reader: sources.SplitReader, tok: Tokenizer):
        self._reader, self._tok = reader, tok

    def __len__(self) -> int:
        return len(self._reader)

    def __getitem__(self, i: int) -> dict:
        text, domain = self._reader[i]
        ids = self._tok.encode(text)
        tokens = np.asarray([self._tok.bos_id, *ids, self._tok.eos_id], np.int32)
        return {'tokens': tokens, 'domain': domain, 'doc': i}


def document_source(data_config, tok: Tokenizer, split: str):
    """Random-access documents {'tokens': int32 [n] with bos/eos, 'domain': int, 'doc': int}."""
    if data_config.get('cache_tokens', True):
        return tokenized_split(data_config, tok, split)
    return _OnTheFly(sources.SplitReader(sources.open_dataset(data_config), split), tok)


class _Chunk(grain.experimental.FlatMapTransform):
    """Splits a document into chunks of <= seq_len tokens, each tagged with its domain."""

    max_fan_out = 1 << 20  # Only used by MapDataset.flat_map; the iter version is unbounded.

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def flat_map(self, doc):
        tokens = doc['tokens']
        out = []
        for a in range(0, len(tokens), self.seq_len):
            piece = tokens[a : a + self.seq_len]
            out.append(
                {'tokens': piece, 'domain_ids': np.full(len(piece), doc['domain'], np.int32)}
            )
        return out


class _Finish(grain.transforms.Map):
    """grain's packed row -> the batch contract; padding gets pad_id tokens and domain -1."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def map(self, packed: dict) -> dict:
        seg = packed['tokens_segment_ids'].astype(np.int32)
        pad = seg == 0
        return {
            'tokens': np.where(pad, self.pad_id, packed['tokens']).astype(np.int32),
            'segment_ids': seg,
            'positions': np.where(pad, 0, packed['tokens_positions']).astype(np.int32),
            'domain_ids': np.where(pad, -1, packed['domain_ids']).astype(np.int32),
        }


def _pack(ds: grain.IterDataset, data_config, tok: Tokenizer, *, seed: int, shuffle_bins: bool):
    seq_len = data_config.seq_len
    ds = grain.experimental.FlatMapIterDataset(ds, _Chunk(seq_len))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct={'tokens': seq_len, 'domain_ids': seq_len},
        num_packing_bins=int(data_config.get('packing_bins', 64)),
        seed=seed,
        shuffle_bins=shuffle_bins,
    )
    return ds.map(_Finish(tok.pad_id))


def _process(process_index, process_count) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax  # noqa: PLC0415 (keeps the data layer importable without initialising JAX)

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f'process_index={process_index} must be in [0, {process_count})')
    return process_index, process_count


def _local_batch(global_batch_size: int, process_count: int) -> int:
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f'global_batch_size must be a positive int, got {global_batch_size!r}')
    if global_batch_size % process_count:
        raise ValueError(
            f'global_batch_size={global_batch_size} is not divisible by process_count='
            f'{process_count}'
        )
    return global_batch_size // process_count


def _read_options(data_config) -> grain.ReadOptions:
    threads = int(data_config.get('read_threads', 0))
    return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4 * threads)


def train_documents(
    data_config, tok: Tokenizer, *, seed: int, process_index: int, process_count: int
) -> grain.MapDataset:
    """This process's infinite document stream (before chunking and packing)."""
    if not isinstance(seed, int | np.integer) or not 0 <= seed < 2**32:
        raise ValueError(f'seed must be an int in [0, 2**32), got {seed!r}')
    docs = grain.MapDataset.source(document_source(data_config, tok, data_config.train_split))
    return docs.shuffle(seed=int(seed)).repeat(None)[process_index::process_count]


def make_train_iterator(
    data_config,
    tok: Tokenizer,
    *,
    global_batch_size: int,
    seed: int,
    process_index: int | None = None,
    process_count: int | None = None,
):
    """Infinite grain iterator of this process's packed batches; get_state()/set_state() resume.

    The state is a JSON-serialisable dict; restoring it continues exactly the same stream.
    """
    process_index, process_count = _process(process_index, process_count)
    local = _local_batch(global_batch_size, process_count)
    docs = train_documents(
        data_config, tok, seed=seed, process_index=process_index, process_count=process_count
    )
    ds = docs.to_iter_dataset(_read_options(data_config))
    ds = _pack(ds, data_config, tok, seed=int(seed), shuffle_bins=True)
    return iter(ds.batch(local, drop_remainder=True))


def _pad_rows(batch: dict, rows: int, pad_id: int) -> dict:
    """Appends all-padding rows up to `rows`."""
    out = {}
    for k, v in batch.items():
        fill = {'domain_ids': -1, 'tokens': pad_id}.get(k, 0)
        pad = np.full((rows - v.shape[0], *v.shape[1:]), fill, v.dtype)
        out[k] = np.concatenate([v, pad])
    return out


def _interleave_domains(src) -> list[int]:
    """Document indices alternating between domains (code, prose, code, ...), each in order.

    A capped evaluation (max_batches) then still sees every domain, not just the first one.
    """
    by_domain: dict[int, list[int]] = {}
    for i in range(len(src)):
        by_domain.setdefault(int(src[i]['domain']), []).append(i)
    groups = [by_domain[d] for d in sorted(by_domain)]
    return [i for row in itertools.zip_longest(*groups) for i in row if i is not None]


def make_eval_batches(
    data_config,
    tok: Tokenizer,
    *,
    global_batch_size: int,
    max_batches: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    split: str | None = None,
) -> list[dict]:
    """Deterministic, finite eval batches of `config.data.eval_split` (no shuffling).

    Global batches are built from the whole split in order (the last one padded with empty rows),
    then each process takes its rows, so every process gets the same number of batches.
    """
    process_index, process_count = _process(process_index, process_count)
    local = _local_batch(global_batch_size, process_count)
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 1):
        raise ValueError(f'max_batches must be None or a positive int, got {max_batches!r}')
    src = document_source(data_config, tok, split or data_config.eval_split)
    order = _interleave_domains(src)
    docs = grain.MapDataset.range(len(order)).map(lambda j: src[order[j]])
    ds = _pack(
        docs.to_iter_dataset(_read_options(data_config)),
        data_config,
        tok,
        seed=0,
        shuffle_bins=False,
    )
    batches = []
    for batch in ds.batch(global_batch_size, drop_remainder=False):
        if max_batches is not None and len(batches) >= max_batches:
            break
        if batch['tokens'].shape[0] < global_batch_size:
            batch = _pad_rows(batch, global_batch_size, tok.pad_id)
        batches.append(
            {k: v[process_index * local : (process_index + 1) * local] for k, v in batch.items()}
        )
    return batches
