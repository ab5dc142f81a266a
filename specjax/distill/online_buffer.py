"""The online draft's replay buffer: a bounded FIFO of (prefix, target distribution) entries.

An entry is one position of a served request: its prefix (the prompt and the tokens emitted
before the position) and the target's log-probabilities of the next token there, at temperature 1
(the loss temperature tempers them in the step, as it tempers a teacher's logits). Which
positions enter (`select`): every one the draft got wrong, where its acceptance probability
alpha_t = sum_v min(p_v, q_v) at the serving temperature (argmax agreement at T = 0) is below
`wrong_below` (at 0.5: a proposal there is more likely rejected than accepted), and a seeded
sample of the rest, each kept with probability `right_fraction`. When the buffer is full the
oldest entries are overwritten, so it follows the traffic.

Fixed-shape arrays (S = capacity, L = the served rows' width, V = the target's vocabulary), so
the buffer checkpoints with the run as one pytree and its memory is fixed by the config:
  tokens   int32 [S, L]    prefix, right-padded with PAD_ID
  length   int32 [S]       prefix length n: logp is the law of the token at index n
  logp     float32 [S, V]  the target's log-probabilities there
  wrong    bool [S]        whether alpha_t < wrong_below when it was added
  request  int32 [S]       the stream index of the request it came from (-1: empty slot)
  written  int64 []        entries ever added (the next slot is written % S)
"""

from __future__ import annotations

import numpy as np

from specjax.sampling import PAD_ID

FIELDS = ('tokens', 'length', 'logp', 'wrong', 'request', 'written')
_RIGHT_TAG = 0x72676874  # the stream of right-position coin flips
_BATCH_TAG = 0x62617463  # the stream of training-batch draws


def entry_bytes(width: int, vocab: int) -> int:
    """Bytes one entry takes: tokens, length, logp, wrong, request."""
    return 4 * width + 4 + 4 * vocab + 1 + 4


class OnlineBuffer:
    """The buffer's arrays (module docstring) and the operations on them; host numpy."""

    def __init__(self, arrays: dict):
        missing = sorted(set(FIELDS) - set(arrays))
        if missing:
            raise ValueError(f'online buffer state lacks {missing}')
        self.arrays = {k: np.asarray(arrays[k]) for k in FIELDS}
        self.capacity, self.width = self.arrays['tokens'].shape
        self.vocab = self.arrays['logp'].shape[1]

    @classmethod
    def empty(cls, capacity: int, width: int, vocab: int) -> OnlineBuffer:
        return cls(
            {
                'tokens': np.full((capacity, width), PAD_ID, np.int32),
                'length': np.zeros((capacity,), np.int32),
                'logp': np.zeros((capacity, vocab), np.float32),
                'wrong': np.zeros((capacity,), bool),
                'request': np.full((capacity,), -1, np.int32),
                'written': np.zeros((), np.int64),
            }
        )

    @property
    def written(self) -> int:
        return int(self.arrays['written'])

    @property
    def filled(self) -> int:
        """Entries held: min(written, capacity)."""
        return min(self.written, self.capacity)

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))

    def state(self) -> dict:
        """The arrays, for a checkpoint (copies: the buffer keeps changing)."""
        return {k: v.copy() for k, v in self.arrays.items()}

    def add(self, seq_BW, rows_M, cols_M, logp_MV, wrong_M, request_M) -> int:
        """Adds M entries: for entry i the prefix seq_BW[rows_M[i], :cols_M[i] + 1] and the law
        logp_MV[i] of the token after it. Oldest entries are overwritten; of more than S new
        ones only the last S are kept. Returns M."""
        m = len(rows_M)
        if m == 0:
            return 0
        seq = np.asarray(seq_BW, np.int32)
        if seq.shape[1] != self.width:
            raise ValueError(f'served rows are {seq.shape[1]} wide, the buffer {self.width}')
        keep = slice(max(m - self.capacity, 0), m)
        rows, cols = np.asarray(rows_M)[keep], np.asarray(cols_M)[keep]
        prefix = np.where(np.arange(self.width)[None, :] <= cols[:, None], seq[rows], PAD_ID)
        slots = (self.written + max(m - self.capacity, 0) + np.arange(len(rows))) % self.capacity
        a = self.arrays
        a['tokens'][slots] = prefix
        a['length'][slots] = cols + 1
        a['logp'][slots] = np.asarray(logp_MV, np.float32)[keep]
        a['wrong'][slots] = np.asarray(wrong_M, bool)[keep]
        a['request'][slots] = np.asarray(request_M, np.int32)[keep]
        a['written'] = np.asarray(self.written + m, np.int64)
        return m

    def sample(self, n: int, *, per_row: int, seed: int, update: int, step: int) -> dict:
        """A training batch of n rows: n requests drawn uniformly (without replacement when the
        buffer holds entries of n) from those with entries, by a seeded generator of (seed,
        update, step); row i holds every entry of its request (at most `per_row`, the most
        tokens a request is served): the longest prefix as tokens [n, L] (the others are its
        prefixes) with its length [n]; the entries' last positions in ascending order, at
        int32 [n, per_row] (0 past them), mask bool [n, per_row] marking them, and their
        log-probs teacher float32 [n, per_row, V] (0 past them)."""
        held = np.flatnonzero(self.arrays['request'] >= 0)
        if not len(held):
            raise ValueError('the online buffer is empty: nothing to sample')
        a = self.arrays
        requests = np.unique(a['request'][held])
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(update), int(step), _BATCH_TAG])
        chosen = np.sort(rng.choice(requests, size=n, replace=len(requests) < n))
        out = {
            'tokens': np.full((n, self.width), PAD_ID, np.int32),
            'length': np.ones((n,), np.int32),
            'at': np.zeros((n, per_row), np.int32),
            'mask': np.zeros((n, per_row), bool),
            'teacher': np.zeros((n, per_row, self.vocab), np.float32),
        }
        for i, request in enumerate(chosen):
            idx = held[a['request'][held] == request]
            idx = idx[np.argsort(a['length'][idx], kind='stable')]
            if len(idx) > per_row:
                raise ValueError(
                    f'online buffer: request {request} holds {len(idx)} entries, more than '
                    f'per_row={per_row} (the most tokens a request is served)'
                )
            m = len(idx)
            out['tokens'][i] = a['tokens'][idx[-1]]
            out['length'][i] = a['length'][idx[-1]]
            out['at'][i, :m] = a['length'][idx] - 1
            out['mask'][i, :m] = True
            out['teacher'][i, :m] = a['logp'][idx]
        return out

    def counts(self) -> dict:
        """{'entries', 'wrong', 'written'} for reports."""
        held = self.arrays['request'] >= 0
        return {
            'entries': int(held.sum()),
            'wrong': int((self.arrays['wrong'] & held).sum()),
            'written': self.written,
        }


def select(alpha_BT, mask_BT, *, wrong_below: float, right_fraction: float, seed: int, round_: int):
    """Positions of a served batch that enter the buffer -> (rows [M], cols [M], wrong [M]).

    alpha_BT: the draft's acceptance probability at each position of the rows (the position
    predicting token t + 1); mask_BT: positions that predict a served token. Every masked
    position with alpha < wrong_below, and each other masked one with probability
    right_fraction (seeded by (seed, round_)), row-major order.
    """
    alpha = np.asarray(alpha_BT, np.float64)
    mask = np.asarray(mask_BT, bool)
    wrong = mask & (alpha < wrong_below)
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(round_), _RIGHT_TAG])
    right = mask & ~wrong & (rng.random(alpha.shape) < right_fraction)
    rows, cols = np.nonzero(wrong | right)
    return rows.astype(np.int32), cols.astype(np.int32), wrong[rows, cols]
