"""Checkpoints for every mode: one orbax CheckpointManager in <workdir>/checkpoints.

A checkpoint at step s holds three items and the digest of their files (specjax_digest.json,
committed with the step; specjax.checkpoint_integrity):
  state  the training state pytree (arrays; restored onto the target shardings you pass),
  data   the training data iterator's state (JSON), so a resumed run continues the same order,
  meta   JSON metadata: 'model_config', 'tokenizer', 'corpus', 'config', 'mode', 'step', plus the
         names of the identity fields ('identity') a resumed run must match.

Nothing is overwritten: orbax refuses to write an existing step, and params are checked finite
before every save, so the last good checkpoint survives a diverged run. Every restore verifies
the digest and that the float arrays read are finite (CorruptCheckpoint naming the step folder;
a step saved before digests existed loads with a warning; $SPECJAX_VERIFY_CHECKPOINTS=0: off).
Consumers (sampling, distill, spec_eval, export) call `load_model(workdir)`: it refuses a corrupt
step. Training skips a step that cannot be read (a missing file, orbax errors) or is corrupt,
with a warning naming it and why, resumes from the newest intact one and moves the skipped ones
to <workdir>/checkpoints_broken/<step>.<time> (never deleted; the step numbers can be reused).

A failed save raises CheckpointWriteError, one line naming the folder, the step and the cause
('no space left on device' for ENOSPC), at the next `check_saves()` (training calls it after
every step), `wait()`, `save()` or `close()`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from specjax import checkpoint_integrity as integrity
from specjax import config_diff
from specjax import workdir as workdir_lib
from specjax.checkpoint_integrity import (  # noqa: F401 (re-exported)
    BROKEN_DIR,
    CheckpointWriteError,
    CorruptCheckpoint,
    check_finite,
)
from specjax.jsonio import to_json
from specjax.workdir import ConfigMismatch

CHECKPOINT_DIR = 'checkpoints'
IMPORT_STEP = 0  # the one step of a workdir written by write_workdir (import, early exit)


class NoIntactCheckpoint(FileNotFoundError):
    """Every checkpoint step in the directory is unreadable (the reasons are in the message)."""


def checkpoint_dir(workdir) -> str:
    """<workdir>/checkpoints as a str: absolute for a local workdir, the URI for gs://."""
    return os.fspath(workdir_lib.path(workdir) / CHECKPOINT_DIR)


class Checkpoints:
    """Save / restore / inspect the checkpoints of one workdir. verify (default:
    integrity.verification_enabled()): restores check digest and finiteness. Saves always use
    orbax's async checkpointer (the digest commits with the step); async_save=False waits."""

    def __init__(
        self,
        workdir: str,
        *,
        keep: int | None = None,
        async_save: bool = True,
        read_only: bool = False,
        verify: bool | None = None,
    ):
        self.directory = checkpoint_dir(workdir)
        self.verify = integrity.verification_enabled() if verify is None else bool(verify)
        self._async = async_save
        self._verified: set[int] = set()
        self._saving: int | None = None  # the step whose async save has not been checked yet
        self._failed = False  # a save error was raised already (close() does not repeat it)
        policy = ocp.checkpoint_managers.LatestN(keep) if keep else None
        async_options = None
        if not read_only:  # the digest is committed with the step (integrity.write_step_digest)
            integrity.quiet_orphaned_write_callbacks()
            digest = lambda: integrity.write_step_digest(self.directory, self._saving)  # noqa: E731
            async_options = ocp.AsyncOptions(post_finalization_callback=digest)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy,
            enable_async_checkpointing=True,
            async_options=async_options,
            read_only=read_only,
            create=not read_only,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=('state', 'data', 'meta')
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def metadata(self, step: int | None = None) -> dict:
        """The 'meta' JSON of `step` (default: latest); FileNotFoundError if there is none."""
        step = self._step(step)
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(meta['meta'])

    def check_identity(self, identity: dict[str, Any], step: int | None = None) -> None:
        """ConfigMismatch (a ValueError) naming the field and both values if `identity` differs.

        Called before anything compiles, so a wrong --workdir fails fast.
        """
        step = self._step(step)
        meta = self.metadata(step)
        for key, value in identity.items():
            if key not in meta:
                raise ConfigMismatch(
                    f'checkpoint {self.directory} step {step} has no {key!r} metadata; it was not '
                    f'made by this mode (mode={meta.get("mode")!r}). Use a new --workdir.'
                )
            diffs = config_diff.differences(meta[key], to_json(value), key)
            if diffs:
                raise ConfigMismatch(
                    f'checkpoint mismatch in {self.directory} (step {step}): '
                    f'{config_diff.describe(diffs, "in the checkpoint", "in this run")}. Use a '
                    'new --workdir or the original settings.'
                )

    def save(
        self, step: int, state, *, data_state: Any, metadata: dict[str, Any], finite: Any = None
    ) -> None:
        """Writes checkpoint `step` (async by default) if `finite` (default: state) is finite.

        Raises FloatingPointError before writing anything if `finite` holds NaN/Inf, ValueError
        if `step` already exists (nothing is ever overwritten), CheckpointWriteError if this or
        the previous save failed.
        """
        check_finite(state if finite is None else finite)
        if step in self.manager.all_steps():
            raise ValueError(f'checkpoint step {step} already exists in {self.directory}')
        self.wait()  # the previous save's error, if any, before starting another
        meta = dict(to_json(metadata), step=int(step))
        self._saving = int(step)
        try:
            saved = self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(to_json(data_state)),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
        except Exception as e:  # orbax / TensorStore raise many types for a failed write
            self._failed = True
            raise integrity.write_error(e, self.directory, step) from e
        if not saved:
            raise RuntimeError(f'orbax declined to save step {step} in {self.directory}')
        if not self._async:
            self.wait()

    def check_saves(self) -> None:
        """CheckpointWriteError if the last async save has finished and failed (cheap)."""
        if self._saving is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def restore(self, abstract_state, step: int | None = None, *, finite=None):
        """Returns (state, data_state, metadata) of `step` (default latest).

        abstract_state: pytree of jax.ShapeDtypeStruct carrying the target shardings. Verifies
        the step first and `finite(state)` (default: the whole state) after reading, unless
        self.verify is off: CorruptCheckpoint naming the step folder otherwise.
        """
        step = self._step(step)
        self.verify_step(step)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        self.check_restored(out['state'] if finite is None else finite(out['state']), step)
        return out['state'], out['data'], dict(out['meta'])

    def step_path(self, step: int) -> str:
        return os.fspath(epath.Path(self.directory) / str(step))

    def verify_step(self, step: int) -> None:
        """CorruptCheckpoint unless `step`'s files match its digest (no-op when verify is off;
        a step without a digest passes with a warning; each step is hashed once)."""
        if self.verify and step not in self._verified:
            integrity.verify_step(self.step_path(step))
            self._verified.add(step)

    def check_restored(self, tree, step: int) -> None:
        """CorruptCheckpoint if a float array of `tree` (restored from `step`) is not finite."""
        if self.verify:
            integrity.check_restored_finite(tree, self.step_path(step))

    def step_problem(self, step: int) -> str | None:
        """Why `step` is not a complete checkpoint (a missing file), or None if it looks whole."""
        return integrity.missing_file(self.step_path(step))

    def newest_readable(
        self, read: Callable[[int], Any], step: int | None = None, *, refuse: tuple = ()
    ):
        """(step, read(step)) for the newest step (<= `step` if given) that `read` can load.

        A step with a missing file or whose read raises is skipped with a warning, except for
        ConfigMismatch (identity and config mismatches) and the exception types in `refuse`,
        which propagate; skipped steps are recorded in self.skipped as (step, reason).
        NoIntactCheckpoint if none can be read.
        """
        steps = sorted(self.all_steps(), reverse=True)
        if step is not None:
            steps = [s for s in steps if s <= step]
        if not steps:
            raise FileNotFoundError(f'no checkpoint in {self.directory}')
        self.skipped: list[tuple[int, str]] = []
        for s in steps:
            reason = self.step_problem(s)
            if reason is None:
                try:
                    return s, read(s)
                except (ConfigMismatch, *refuse):
                    raise
                except Exception as e:  # orbax/TensorStore raise many types for unreadable data
                    reason = f'{type(e).__name__}: {integrity.first_line(e)}'
            self.skipped.append((s, reason))
            logging.warning(
                'checkpoint step %d in %s cannot be read (%s); it is left in place and the '
                'next older step is tried',
                s,
                self.directory,
                reason,
            )
        raise NoIntactCheckpoint(
            f'no readable checkpoint in {self.directory}: '
            + '; '.join(f'step {s}: {r}' for s, r in self.skipped)
            + '. Move the checkpoints/ folder aside to start afresh.'
        )

    def move_aside(self, steps) -> list[str]:
        """Moves step folders to <workdir>/checkpoints_broken/<step>.<time>; returns new paths.

        Process 0 moves, every process then waits for it and reloads its step list.
        """
        moved = integrity.move_aside(self.directory, steps) if jax.process_index() == 0 else []
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices('specjax_checkpoints_moved_aside')
        self.manager.reload()
        return moved

    def wait(self) -> None:
        """Blocks until pending async saves are committed; CheckpointWriteError if one failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._failed = True
            raise integrity.write_error(e, self.directory, self._saving) from e
        finally:
            self._saving = None

    def close(self) -> None:
        """Waits for pending saves (raising their error unless one was raised already) and
        releases orbax's threads, whatever happened: no save thread outlives this call."""
        try:
            if self._failed:
                with contextlib.suppress(Exception):
                    self.manager.wait_until_finished()
            else:
                self.wait()
        finally:
            self.manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _step(self, step):
        if step is None:
            step = self.manager.latest_step()
        if step is None:
            raise FileNotFoundError(f'no checkpoint in {self.directory}')
        if step not in self.manager.all_steps():
            raise FileNotFoundError(
                f'no checkpoint step {step} in {self.directory}; have {self.all_steps()}'
            )
        return step


def abstract_with_shardings(abstract, shardings):
    """ShapeDtypeStructs of `abstract` carrying the matching NamedSharding from `shardings`."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def load_model(
    workdir: str,
    step: int | None = None,
    *,
    mesh=None,
    rules=None,
    params_key: str = 'params',
    config_key: str = 'model_config',
    scan_layers: bool | None = None,
):
    """Loads a trained Transformer from `workdir`'s checkpoint -> (model, metadata).

    Only the parameters are read (optimizer state is skipped). By default they land on the
    default device; pass `mesh` and `rules` (config.mesh.rules) to restore them sharded.
    params_key / config_key select another model in the state (e.g. a co-trained draft).
    scan_layers converts to that block layout (None: as saved; see specjax.models.layout), so
    a workdir saved stacked loads unstacked and vice versa; metadata stays as saved.
    The step is verified first (CorruptCheckpoint naming its folder: it is refused, never
    skipped for an older one; checkpoint_integrity.verification_enabled() turns this off).
    """
    from specjax.models import TransformerConfig, abstract_model
    from specjax.models.layout import to_layout
    from specjax.parallel import param_shardings

    if scan_layers is not None and not isinstance(scan_layers, bool):
        raise ValueError(f'load_model scan_layers must be None or a bool, got {scan_layers!r}')

    def read(step):
        meta = ckpts.metadata(step)
        if config_key not in meta:
            raise ConfigMismatch(
                f'checkpoint step {step} in {ckpts.directory} has no {config_key!r}'
            )
        cfg = TransformerConfig.from_dict(meta[config_key])
        ckpts.verify_step(step)
        graphdef, abstract_params = abstract_model(cfg)
        if mesh is not None:
            shardings = param_shardings(mesh, abstract_params, rules)
        else:
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            shardings = jax.tree.map(lambda _: device, abstract_params)
        target = {params_key: abstract_with_shardings(abstract_params, shardings)}
        restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), target)
        out = ckpts.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=target, restore_args=restore_args, partial_restore=True
                )
            ),
        )
        ckpts.check_restored(out['state'][params_key], step)
        model = nnx.merge(graphdef, out['state'][params_key])
        if scan_layers is not None and scan_layers != cfg.scan_layers:
            model = to_layout(model, scan_layers)
            params = nnx.state(model)
            if mesh is not None:
                params = jax.device_put(params, param_shardings(mesh, params, rules))
            else:
                params = jax.device_put(params, jax.local_devices()[0])
            nnx.update(model, params)
        return model, meta

    with Checkpoints(workdir, read_only=True) as ckpts:
        if step is None:
            _, (model, meta) = ckpts.newest_readable(read, refuse=(CorruptCheckpoint,))
        else:
            model, meta = read(ckpts._step(step))
    return model, meta


def write_workdir(model, tokenizer, workdir: str, *, source: dict, mode: str = 'import') -> str:
    """Saves `model` and `tokenizer` as a workdir that load_model reads; refuses to overwrite."""
    workdir = os.path.abspath(os.path.expanduser(workdir))
    with Checkpoints(workdir, async_save=False) as ckpts:
        if ckpts.all_steps():
            raise ValueError(
                f'--workdir={workdir} already holds checkpoints {ckpts.all_steps()}; use a new one'
            )
        _, params = nnx.split(model)
        metadata = {
            'model_config': model.config.to_dict(),
            'tokenizer': tokenizer.identity(),
            'mode': mode,
            'source': source,
            'num_params': model.config.num_params,
        }
        ckpts.save(IMPORT_STEP, {'params': params}, data_state={}, metadata=metadata)
    tokenizer.save(workdir)
    return workdir
