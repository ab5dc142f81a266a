"""The error every interop reader raises for a model file it cannot trust the bytes of."""

from __future__ import annotations

import os

from specjax.errors import SpecjaxError


class CorruptModelFileError(SpecjaxError, ValueError):
    """A GGUF, safetensors or JSON file that is truncated or malformed.

    The message names the file, the tensor (when one is concerned), the bytes expected and
    available (when the problem is a size), and ends with 'the file is truncated or corrupt'.
    A SpecjaxError: command lines print it as one line.
    """

    def __init__(self, path: str | os.PathLike, problem: str, *, tensor: str | None = None):
        self.path = os.fspath(path)
        self.tensor = tensor
        where = f'{self.path}: tensor {tensor!r}' if tensor is not None else self.path
        super().__init__(f'{where}: {problem}; the file is truncated or corrupt')
