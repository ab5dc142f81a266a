"""The training state pytree and its sharded initialisation on a mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from specjax.checkpoint import abstract_with_shardings
from specjax.models import Transformer, TransformerConfig, abstract_model
from specjax.parallel import check_divisible, param_shardings, replicated


@flax.struct.dataclass
class TrainState:
    """step int32 [], params nnx.State, opt_state (optax), rng uint32 [2] raw PRNG key."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def opt_state_shardings(tx, abstract_opt_state, params_shardings, mesh):
    """Optimizer-state shardings: param-shaped moments follow params, counters replicate."""
    return optax.tree_utils.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_opt_state,
        params_shardings,
        transform_non_params=lambda _: replicated(mesh),
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )


def state_shardings(tx, abstract_params, mesh, rules) -> TrainState:
    """A TrainState of NamedShardings for `abstract_params` trained with `tx` on `mesh`."""
    p_shardings = param_shardings(mesh, abstract_params, rules)
    check_divisible(abstract_params, p_shardings)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    return TrainState(
        step=replicated(mesh),
        params=p_shardings,
        opt_state=opt_state_shardings(tx, abstract_opt, p_shardings, mesh),
        rng=replicated(mesh),
    )


def make_init_fn(cfg: TransformerConfig, tx):
    """seed int -> TrainState: builds the model from split(PRNGKey(seed)) and tx.init(params)."""

    def init(seed):
        init_key, state_key = jax.random.split(jax.random.PRNGKey(seed))
        _, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=init_key)))
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=state_key
        )

    return init


class StatePlan(NamedTuple):
    """What a mode needs before any array exists: structure, shardings, restore target, init."""

    graphdef: Any  # nnx.GraphDef of the Transformer
    shardings: TrainState  # NamedSharding per leaf
    abstract: TrainState  # ShapeDtypeStructs with shardings: the checkpoint restore target
    init: Callable[[], TrainState]  # builds a fresh state, sharded, in one jit


def plan_train_state(cfg: TransformerConfig, tx, seed: int, mesh, rules) -> StatePlan:
    """Plans a TrainState for a `cfg` model trained with `tx` on `mesh` (nothing compiled yet)."""
    graphdef, abstract_params = abstract_model(cfg)
    shardings = state_shardings(tx, abstract_params, mesh, rules)
    init_fn = make_init_fn(cfg, tx)
    abstract = abstract_with_shardings(jax.eval_shape(init_fn, jnp.int32(seed)), shardings)

    def init():
        return jax.jit(init_fn, out_shardings=shardings)(jnp.int32(seed))

    return StatePlan(graphdef, shardings, abstract, init)
