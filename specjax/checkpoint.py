"""Checkpoints for every mode: one orbax CheckpointManager in <workdir>/checkpoints.

A checkpoint at step s holds three items:
  state  the training state pytree (arrays; restored onto the target shardings you pass),
  data   the training data iterator's state (JSON), so a resumed run continues the same order,
  meta   JSON metadata: 'model_config', 'tokenizer', 'corpus', 'config', 'mode', 'step', plus the
         names of the identity fields ('identity') a resumed run must match.

Nothing is overwritten: orbax refuses to write an existing step, and params are checked finite
before every save, so the last good checkpoint survives a diverged run. Consumers (sampling,
distill, spec_eval) call `load_model(workdir)`.

A step that cannot be read (orbax metadata or an item missing, a truncated array file) is skipped
with a warning naming the step and the reason, and the newest intact step is used instead; it is
never deleted. A training run that resumes past broken steps moves them to
<workdir>/checkpoints_broken/<step>.<time> (so the step numbers can be written again).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from specjax import workdir as workdir_lib
from specjax.jsonio import first_difference, to_json
from specjax.workdir import ConfigMismatch

CHECKPOINT_DIR = 'checkpoints'
BROKEN_DIR = 'checkpoints_broken'
# Files every committed step has (orbax's step metadata, then each item's own metadata).
IMPORT_STEP = 0  # the one step of a workdir written by write_workdir (import, early exit)
_REQUIRED_FILES = ('_CHECKPOINT_METADATA', 'state/_METADATA', 'data/metadata', 'meta/metadata')


class NoIntactCheckpoint(FileNotFoundError):
    """Every checkpoint step in the directory is unreadable (the reasons are in the message)."""


def checkpoint_dir(workdir) -> str:
    """<workdir>/checkpoints as a str: absolute for a local workdir, the URI for gs://."""
    return os.fspath(workdir_lib.path(workdir) / CHECKPOINT_DIR)


def _all_finite(tree):
    """Whether every float leaf is finite. Arrays spread over several processes are checked
    shard by shard on the host (no cross-process program: each process checks its own shards)."""
    if any(not getattr(x, 'is_fully_addressable', True) for x in jax.tree.leaves(tree)):
        return all(
            bool(np.isfinite(np.asarray(s.data)).all())
            for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)
            for s in x.addressable_shards
        )
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def check_finite(tree, what: str = 'params') -> None:
    """Raises FloatingPointError naming the first non-finite leaf of `tree`."""
    if bool(_all_finite(tree)):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        inexact = jnp.issubdtype(leaf.dtype, jnp.inexact)
        if inexact and not bool(jnp.all(jnp.isfinite(leaf))):
            raise FloatingPointError(f'non-finite values in {what}{jax.tree_util.keystr(path)}')
    raise FloatingPointError(f'non-finite values in {what}')


class Checkpoints:
    """Save / restore / inspect the checkpoints of one workdir."""

    def __init__(
        self,
        workdir: str,
        *,
        keep: int | None = None,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = checkpoint_dir(workdir)
        policy = ocp.checkpoint_managers.LatestN(keep) if keep else None
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy,
            enable_async_checkpointing=async_save,
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
            diff = first_difference(meta[key], to_json(value), key)
            if diff:
                field, saved, current = diff
                raise ConfigMismatch(
                    f'checkpoint mismatch in {self.directory} (step {step}): {field} is {saved!r} '
                    f'in the checkpoint but {current!r} in this run. Use a new --workdir or the '
                    'original settings.'
                )

    def save(
        self, step: int, state, *, data_state: Any, metadata: dict[str, Any], finite: Any = None
    ) -> None:
        """Writes checkpoint `step` (async by default) if `finite` (default: state) is finite.

        Raises FloatingPointError before writing anything if `finite` holds NaN/Inf, and
        ValueError if `step` already exists (nothing is ever overwritten).
        """
        check_finite(state if finite is None else finite)
        if step in self.manager.all_steps():
            raise ValueError(f'checkpoint step {step} already exists in {self.directory}')
        meta = dict(to_json(metadata), step=int(step))
        saved = self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(to_json(data_state)),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        if not saved:
            raise RuntimeError(f'orbax declined to save step {step} in {self.directory}')

    def restore(self, abstract_state, step: int | None = None):
        """Returns (state, data_state, metadata) of `step` (default latest).

        abstract_state: pytree of jax.ShapeDtypeStruct carrying the target shardings.
        """
        step = self._step(step)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return out['state'], out['data'], dict(out['meta'])

    def step_problem(self, step: int) -> str | None:
        """Why `step` is not a complete checkpoint (a missing file), or None if it looks whole."""
        step_dir = epath.Path(self.directory) / str(step)
        for name in _REQUIRED_FILES:
            if not (step_dir / name).exists():
                return f'{name} is missing'
        return None

    def newest_readable(self, read: Callable[[int], Any], step: int | None = None):
        """(step, read(step)) for the newest step (<= `step` if given) that `read` can load.

        A step with a missing file or whose read raises (except ConfigMismatch: identity and
        config mismatches propagate) is skipped with a warning; skipped steps are recorded in
        self.skipped as (step, reason). NoIntactCheckpoint if none can be read.
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
                except ConfigMismatch:
                    raise
                except Exception as e:  # orbax/TensorStore raise many types for unreadable data
                    reason = f'{type(e).__name__}: {_first_line(e)}'
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
        stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
        dest_root = epath.Path(self.directory).parent / BROKEN_DIR
        moved = []
        for step in steps if jax.process_index() == 0 else ():
            dest = dest_root / f'{step}.{stamp}'
            dest_root.mkdir(parents=True, exist_ok=True)
            (epath.Path(self.directory) / str(step)).rename(dest)
            logging.warning('moved unreadable checkpoint step %d to %s (not deleted)', step, dest)
            moved.append(os.fspath(dest))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices('specjax_checkpoints_moved_aside')
        self.manager.reload()
        return moved

    def wait(self) -> None:
        """Blocks until pending async saves are committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ''


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
    """
    from specjax.models import Transformer, TransformerConfig
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
        abstract_model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        graphdef, abstract_params = nnx.split(abstract_model)
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
            _, (model, meta) = ckpts.newest_readable(read)
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
