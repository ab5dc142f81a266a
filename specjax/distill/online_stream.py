"""One domain of the corpus at a time: the request stream of the online mode, and the training
rows of its prerequisite drafts (a draft distilled on the first domain, one on the second).

Both cut windows out of documents of one domain (config.data's `domain_feature`, e.g. the
embedded corpus's 'code' and 'prose'), chosen by seeded generators of (seed, index), so any
position of a stream or an iterator is a pure function of its settings (resume-safe).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.data import open_dataset
from specjax.data.pipeline import document_source
from specjax.sampling import PAD_ID
from specjax.train.runs import RunData

_ROWS_TAG = 0x726F7773
_STREAM_TAG = 0x73747265


def domain_documents(data_config, tok, split: str, domain: str, field: str):
    """(document source, indices of its documents of `domain`); ValueError naming `field` when
    the corpus has no such domain or the split no document of it."""
    names = tuple(open_dataset(data_config).domain_names)
    if domain not in names:
        raise ValueError(f'{field}={domain!r} is not a domain of the corpus; domains: {names}')
    source = document_source(data_config, tok, split)
    domains = getattr(source, 'domains', None)
    if domains is None:  # documents tokenized as they are read
        domains = np.asarray([source[i]['domain'] for i in range(len(source))])
    docs = np.flatnonzero(np.asarray(domains) == names.index(domain))
    if not len(docs):
        raise ValueError(f'{field}={domain!r}: split {split!r} has no document of that domain')
    return source, docs


def _window(rng, source, docs, length: int, prompt: bool = False) -> np.ndarray:
    """`length` tokens (fewer when the document is shorter) from a random document of `docs`,
    at a random offset; a `prompt` never holds the document's closing eos."""
    tokens = np.asarray(source[int(docs[rng.integers(len(docs))])]['tokens'], np.int32)
    tokens = tokens[:-1] if prompt else tokens
    start = int(rng.integers(max(len(tokens) - length, 0) + 1))
    return tokens[start : start + length]


class DomainRows:
    """Infinite iterator of host batches in the data pipeline's layout (tokens, segment_ids,
    positions, domain_ids, int32 [B, T]) whose rows are windows of documents, one window per
    row (segment 1, padding 0 after a short document); `parts` is a list of (document source,
    document indices, domain id), row r of batch n taken from part (n * B + r) % len(parts), so
    two parts are balanced whatever their sizes. Batch n is drawn from (seed, n):
    get_state() / set_state() ({'batch': n}) resume it exactly."""

    def __init__(self, parts, *, batch_size: int, seq_len: int, seed: int):
        self.parts = list(parts)
        self.batch_size, self.seq_len, self.seed = int(batch_size), int(seq_len), int(seed)
        self.batch = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.batch, _ROWS_TAG])
        first = self.batch * self.batch_size
        self.batch += 1
        shape = (self.batch_size, self.seq_len)
        out = {
            'tokens': np.full(shape, PAD_ID, np.int32),
            'segment_ids': np.zeros(shape, np.int32),
            'positions': np.zeros(shape, np.int32),
            'domain_ids': np.full(shape, -1, np.int32),
        }
        for row in range(self.batch_size):
            source, docs, domain_id = self.parts[(first + row) % len(self.parts)]
            piece = _window(rng, source, docs, self.seq_len)
            n = len(piece)
            out['tokens'][row, :n] = piece
            out['segment_ids'][row, :n] = 1
            out['positions'][row, :n] = np.arange(n)
            out['domain_ids'][row, :n] = domain_id
        return out

    def get_state(self) -> dict:
        return {'batch': self.batch}

    def set_state(self, state: dict) -> None:
        self.batch = int(state['batch'])


def domain_run_data(config, tok, domains, fields) -> RunData:
    """RunData of a training config (config.data, .train, .seed) whose rows come from
    `domains` (names; several: balanced row by row), fields naming each in errors: train rows
    from the train split, config.train.eval_batches fixed batches from the eval split; the
    corpus identity names the domains (a checkpoint of other domains is refused)."""
    from specjax.data import corpus_identity

    data = config.data
    names = tuple(open_dataset(data).domain_names)
    batch, seq_len = int(config.train.batch_size), int(data.seq_len)

    def parts(split):
        out = []
        for domain, field in zip(domains, fields, strict=True):
            source, docs = domain_documents(data, tok, split, domain, field)
            out.append((source, docs, names.index(domain)))
        return out

    train = DomainRows(parts(data.train_split), batch_size=batch, seq_len=seq_len,
                       seed=int(config.seed))  # fmt: skip
    held_out = DomainRows(parts(data.eval_split), batch_size=batch, seq_len=seq_len,
                          seed=int(config.seed) + 1)  # fmt: skip
    return RunData(
        train=train,
        eval_batches=[next(held_out) for _ in range(int(config.train.eval_batches))],
        tokenizer=tok.identity(),
        corpus=dict(corpus_identity(data), domains=list(domains)),
        vocab_size=tok.vocab_size,
        domains=names,
        eos_id=tok.eos_id,
    )


@dataclasses.dataclass(frozen=True)
class Stream:
    """The requests: prompts int32 [R, P] right-padded with PAD_ID, lengths int32 [R], and the
    domain of each, [R] names; the first `shift` requests come from domains[0], the rest from
    domains[1]."""

    prompts: np.ndarray
    lengths: np.ndarray
    domains: np.ndarray
    shift: int

    def batch(self, start: int, size: int):
        """Requests start .. start + size - 1: (prompts [size, P], lengths [size])."""
        return self.prompts[start : start + size], self.lengths[start : start + size]


def make_stream(data_config, tok, stream, seed: int) -> Stream:
    """config.stream -> Stream: request i is a window of L_i ~ U[prompt_len_min,
    prompt_len_max] tokens of a document of its domain in split stream.split, drawn from
    (seed, i); the shift is at request stream.requests // 2."""
    requests, width = int(stream.requests), int(stream.prompt_len_max)
    shift = requests // 2
    sources = [
        domain_documents(data_config, tok, stream.split, d, f'config.stream.domains[{i}]')
        for i, d in enumerate(stream.domains)
    ]
    prompts = np.full((requests, width), PAD_ID, np.int32)
    lengths = np.zeros((requests,), np.int32)
    for i in range(requests):
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, i, _STREAM_TAG])
        length = int(rng.integers(int(stream.prompt_len_min), width + 1))
        piece = _window(rng, *sources[int(i >= shift)], length, prompt=True)
        prompts[i, : len(piece)] = piece
        lengths[i] = len(piece)
    domains = np.asarray([stream.domains[int(i >= shift)] for i in range(requests)], dtype=object)
    return Stream(prompts, lengths, domains, shift)
