"""Errors a user can act on: refusals whose message says what is wrong and what to do.

`specjax.main` (and `python -m specjax.interop`) print a refusal — `is_user_error`: a
`SpecjaxError`, or a ValueError / FileNotFoundError / FileExistsError / ImportError raised by
specjax's own code — as one line, `FATAL <message>`, and exit with USER_ERROR_EXIT_CODE, without
a traceback unless asked (`--verbose_errors` or SPECJAX_TRACEBACK=1). The message must therefore
stand alone: name the field, file or path, the value found and what to do. Which errors count is
decided by where they are raised, not when: specjax's checks name what they refuse whether they
run before training or later, while the same builtin types raised inside a library (numpy, jax,
orbax) keep their traceback. This module imports nothing from specjax, so every layer may raise
these.

Subclasses keep the builtin base the same refusal had before (ValueError, RuntimeError), so
callers that catch those still do.
"""

from __future__ import annotations

USER_ERROR_EXIT_CODE = 2  # a refusal: nothing ran or nothing more was written; fix and rerun
TRACEBACK_ENV = 'SPECJAX_TRACEBACK'  # '1': refusals print their traceback as well


class SpecjaxError(Exception):
    """Base of the refusals a user acts on; the message is the whole story (one line)."""


class ConfigDriftError(SpecjaxError, ValueError):
    """A run's config differs from the one recorded in its workdir; the message names every
    differing field with both values."""


class WorkdirLockedError(SpecjaxError, RuntimeError):
    """Another live process holds the workdir; the message names the holder."""


class ConfigValueError(SpecjaxError, ValueError):
    """A config field holds a value that cannot run; the message names the field and value."""


class StopRequested(BaseException):
    """SIGTERM arrived where no training loop could stop at a step boundary (start-up, an
    evaluation, a stage between loops): raised from specjax.main's handler so the run unwinds
    (locks released, atomic writes either done or not) and exits PREEMPTED_EXIT_CODE. A
    BaseException, like KeyboardInterrupt, so `except Exception` does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# Builtin errors that specjax's own code raises to refuse an input: with the raise in a specjax
# module they name the field, path or value (the code style), so they are refusals too. The
# same types raised inside a library (numpy's 'cannot reshape', jax's shape errors) are not:
# those keep their traceback, the only pointer to where specjax called the library.
_REFUSAL_TYPES = (ValueError, FileNotFoundError, FileExistsError, ImportError)


def _raised_in(exc: BaseException) -> str:
    """The file of the innermost frame of exc's traceback ('' without one)."""
    tb = exc.__traceback__
    if tb is None:
        return ''
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename


def is_user_error(exc: BaseException, package_dir: str) -> bool:
    """Whether `exc` is a refusal to print as one line: a SpecjaxError, or one of
    _REFUSAL_TYPES raised by code under package_dir (specjax's own folder)."""
    if isinstance(exc, SpecjaxError):
        return True
    if not isinstance(exc, _REFUSAL_TYPES):
        return False
    where = _raised_in(exc)
    return bool(where) and where.startswith(package_dir.rstrip('/') + '/')


def one_line(exc: BaseException) -> str:
    """The message on one line (line breaks and their indentation become single spaces)."""
    text = ' '.join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = str(exc.args[0])
    return text
