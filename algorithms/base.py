"""What every federated algorithm shares: its interface, state and checks.

An algorithm is an :class:`Algorithm`, a pair of pure functions

* ``init(params) -> state``: the server state, a ``NamedTuple`` whose
  ``params`` is the server model and whose ``hparams`` holds the
  hyperparameters a round reads (learning rates, momentum, ``mu``, ...), as
  arrays, so they can be changed between rounds without recompiling and
  differentiated through (hypergradients);
* ``round(state, cohort, key) -> (state, metrics)``: one round of training on
  a cohort of clients, jit-compiled with the state donated;

An algorithm whose clients keep state between rounds outside the server
state (``client_state_init`` set: SCAFFOLD's ``c_i``, a personal model) reads
the cohort's rows of it from ``cohort.client_states`` and returns their new
values as a third output, ``round(state, cohort, key) -> (state, metrics,
client_states)``; the caller keeps the rows (``docs/client_state.md``).

plus ``run_rounds``, many rounds in one compiled call (``lax.scan`` over a
stack of cohorts), and ``apply``, the round as a plain function for use
inside ``jax.grad``, ``jax.vmap`` or a caller's own ``jit``.

A round is a fedjx program: the cohort size ``C`` is read from the cohort's
shapes at trace time and declared with ``fedjx.program(clients=C)``.

Hyperparameters of optimizers are traced when the optimizer is built with
``optax.inject_hyperparams`` (the defaults of this package are): ``init``
copies the optimizer's hyperparameters into ``state.hparams[<argument
name>]`` and every round writes them back into the optimizer state before
using it, so ``state.hparams`` is the one place to read or change them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
import fedjx.indexed
from fedjx import constant_hoisting
from fedjx import options
from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.traits import Traits

Params = Any
"""A model's parameters: any pytree of arrays."""
PyTree = Any
"""Any pytree (updates, optimizer states, per-client values)."""
Cohort = Any  # Any object with batches, mask, num_examples, client_ids.
Metrics = dict[str, jax.Array]
"""A round's metrics: a flat dict of scalars (or placed ``[C]`` arrays)."""
LossFn = Callable[[Params, Mapping[str, jax.Array]], jax.Array]
"""``loss_fn(params, batch) -> [B]``: per-example losses."""
MetricsFn = Callable[[Params, Mapping[str, jax.Array]], Mapping[str, jax.Array]]
"""``metrics_fn(params, batch) -> {name: [B]}``: per-example metrics."""

WEIGHTINGS = ('num_examples', 'uniform')
"""The client weightings ``w_i`` of :func:`aggregation_weights`."""


class Algorithm(NamedTuple):
  """A federated algorithm.

  Attributes:
    init: ``init(params) -> state``; the state is a NamedTuple with
      ``params`` (the server model) and ``hparams`` (traced hyperparameters).
    round: ``round(state, cohort, key) -> (state, metrics)``, jit-compiled
      with the arrays it closes over as arguments
      (:func:`fedjx.constant_hoisting.jit`), donating ``state``; ``metrics``
      is a flat dict of scalars.
    run_rounds: ``run_rounds(state, cohorts, keys) -> (state, metrics)``: one
      round per entry of the leading axis of ``cohorts`` (every leaf stacked
      ``[R, C, ...]``) and ``keys`` (``[R]`` keys), in one compiled
      ``lax.scan``, donating ``state``; each metric is stacked to ``[R]``.
    apply: the round as a plain, un-jitted function with the signature of
      ``round``; compose it with ``jax.grad`` (e.g. with respect to
      ``state.hparams``), ``jax.vmap`` or :func:`scan_rounds`. It does not
      donate: ``apply(state, ...)`` twice from one state compares variants.
    compiler: ``compiler(map_options, donate) -> Algorithm``, with
      ``map_options`` a checked :class:`fedjx.options.MapOptions`; used by
      :meth:`compile` (None for algorithms assembled by hand).
    client_state_init: None for an algorithm whose clients keep no state
      outside the server state. Otherwise ``client_state_init(params) ->
      pytree``: the state of one client that has never participated (the
      value a store returns for it). Then ``round`` reads the cohort's rows
      from ``cohort.client_states`` (leaves ``[C, ...]``) and returns
      ``(state, metrics, client_states)``, the rows' new values (a padding
      client's row is returned unchanged); ``run_rounds`` is refused, since
      a client drawn in two rounds of one scan would miss its own update.
    traits: what the algorithm declares about itself
      (:class:`fedjx.algorithms.traits.Traits`: what a round releases
      beside its aggregate, whether it reads an indexed cohort as it is,
      ...); every wrapper of an algorithm keeps it, and ``client_state_init``,
      as they are (it builds its algorithm as ``wrapped._replace(init=...,
      round=..., ...)``).
  """

  init: Callable[[Params], Any]
  round: Callable[[Any, Cohort, jax.Array], tuple[Any, Metrics]]
  run_rounds: Callable[[Any, Cohort, jax.Array], tuple[Any, Metrics]]
  apply: Callable[[Any, Cohort, jax.Array], tuple[Any, Metrics]]
  compiler: Callable[..., 'Algorithm'] | None = None
  client_state_init: Callable[[Params], PyTree] | None = None
  traits: Traits = traits_lib.NONE

  def compile(self, map_strategy: 'str | options.MapOptions' = 'auto',
              chunk_size: int | None = None,
              donate: bool = True) -> 'Algorithm':
    """The algorithm with its rounds run under these execution options.

    How clients run is not part of an algorithm: every builder makes the
    same round, and ``compile`` chooses how ``fedjx.program`` maps it over
    clients. The options are checked here, once, and carried from here as
    one :class:`fedjx.options.MapOptions`.

    Args:
      map_strategy: one of ``fedjx.MAP_STRATEGIES`` (``'auto'``, ``'vmap'``,
        ``'chunked'``, ``'sequential'``), see ``fedjx.program``; or a
        :class:`fedjx.options.MapOptions` already checked (e.g. a config's,
        ``fedjx.options.RoundOptions.of(config).map``; then ``chunk_size``
        is None).
      chunk_size: clients per chunk for ``map_strategy='chunked'`` (a
        positive int or None).
      donate: whether ``round`` and ``run_rounds`` donate the state's
        buffers (the default; the state passed in is consumed). False keeps
        it, so one state can be run twice, e.g. to compare variants.

    Returns:
      A new :class:`Algorithm` whose ``round``, ``run_rounds`` and ``apply``
      use the options; ``init`` is unchanged.
    """
    fn = 'Algorithm.compile'
    map_options = options.MapOptions.of(map_strategy, chunk_size, f'{fn}: ')
    options.check_donate(donate, f'{fn}: ')
    if self.compiler is None:
      raise ValueError(f'{fn}: this Algorithm has compiler=None (it was not '
                       'made by make_algorithm), so it cannot be recompiled.')
    return self.compiler(map_options, donate)


# The map options of an algorithm not compiled yet: 'auto', no chunk size.
_DEFAULT_MAP = options.MapOptions()


class ServerState(NamedTuple):
  """The server state: one record for every algorithm.

  Attributes:
    params: the server model.
    opt_state: the server optimizer's state (``()`` without one).
    hparams: traced hyperparameters, by name: the optimizers' (under their
      option names), the algorithm's own, the client transform's and the
      aggregator's.
    round_index: number of rounds run so far (int32 scalar).
    aggregator_state: the aggregator's state (``()`` when it has none).
    extras: the algorithm's own server state beyond these (``()`` when it
      has none), e.g. FedDyn's ``h``, SCAFFOLD's control variate ``c``;
      each algorithm's docstring says what it holds.
    client_states: the clients' own state when the server keeps it (leaves
      ``[N, ...]``, indexed by client id: SCAFFOLD's dense ``c_i``, DiLoCo's
      inner optimizer states); ``()`` otherwise.
  """

  params: Params
  opt_state: optax.OptState
  hparams: dict[str, Any]
  round_index: jax.Array
  aggregator_state: Any = ()
  extras: Any = ()
  client_states: Any = ()


# ------------------------------------------------------------------ checks

def check_choice(fn: str, name: str, value: Any, allowed: tuple[Any, ...]) -> None:
  """Raises unless ``value`` is one of ``allowed``."""
  if value not in allowed:
    raise ValueError(f'{fn}: {name}={value!r} is not one of {allowed}.')


def check_number(fn: str, name: str, value: Any, *, low: float = 0.0,
                 strict: bool = False, high: float | None = None) -> None:
  """Raises unless a number is finite and in ``[low, high]`` (``(low, high]`` if strict).

  NaN and +-Inf are never allowed: an infinite learning rate or coefficient
  turns the model into NaN in the first round. Traced values (inside ``jit``
  or ``grad``) cannot be checked and pass.
  """
  if jnp.ndim(value) > 0:
    return
  try:
    v = float(value)
  except (jax.errors.ConcretizationTypeError,
          jax.errors.TracerArrayConversionError):
    return
  except (TypeError, ValueError):
    raise ValueError(f'{fn}: {name}={value!r} must be a number.') from None
  bad = not math.isfinite(v) or v < low or (strict and v == low) or (
      high is not None and v > high)
  if bad:
    bound = f'> {low}' if strict else f'>= {low}'
    if high is not None:
      bound += f' and <= {high}'
    raise ValueError(f'{fn}: {name}={value!r} is not allowed; it must be a '
                     f'finite number {bound}.')


def check_positive_int(fn: str, name: str, value: Any, *,
                       allow_none: bool = False) -> None:
  """Raises unless ``value`` is an int ``>= 1`` (or None, if ``allow_none``)."""
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f'{fn}: {name}={value!r} must be a positive int'
                     + (' or None.' if allow_none else '.'))


def check_private_uploads(fn: str, aggregator: Any,
                          unprivatized: str | None) -> None:
  """Refuses a DP aggregator for a round that releases more than it noises.

  A DP aggregator (``aggregator.traits.privacy`` set) clips each client's
  message to a bound ``C`` and noises their aggregate (McMahan et al. 2018;
  Agarwal et al. 2021 in a secure sum; each client itself for local DP), so
  its epsilon is that of the release of the aggregate alone. An algorithm
  whose round also releases something else computed from the clients' data
  declares what (``unprivatized``, its ``Traits.unprivatized``) and takes
  no DP aggregator: the one rule every DP aggregator's check follows, in
  one line naming the algorithm, the aggregator and why.
  """
  privacy = traits_lib.of(aggregator).privacy
  if privacy is not None and unprivatized is not None:
    raise ValueError(
        f'{fn}: aggregator {privacy} is refused: {unprivatized}; use a '
        'non-private aggregator.')


def check_optimizer(fn: str, name: str, optimizer: Any) -> None:
  """Raises unless ``optimizer`` has ``init`` and ``update`` (optax's interface)."""
  if not (hasattr(optimizer, 'init') and hasattr(optimizer, 'update')):
    raise ValueError(f'{fn}: {name}={optimizer!r} is not an '
                     'optax.GradientTransformation (it needs init and update).')


# Constraints on hyperparameters, by name: the keys of optax's injected
# hyperparameters and the scalar entries of ``state.hparams``.
_HPARAM_BOUNDS = {
    'learning_rate': dict(low=0.0),
    'client_learning_rate': dict(low=0.0, strict=True),
    'momentum': dict(low=0.0, high=1.0),
    'weight_decay': dict(low=0.0),
    'eps': dict(low=0.0),
    'mu': dict(low=0.0),
    'clip_norm': dict(low=0.0, strict=True),
    'noise_multiplier': dict(low=0.0),
}


def check_hparams(fn: str, hparams: Mapping[str, Any]) -> None:
  """Checks the concrete values of ``state.hparams`` (keyed by argument name)."""
  for arg, value in hparams.items():
    if isinstance(value, Mapping):
      for key, v in value.items():
        if key in _HPARAM_BOUNDS:
          check_number(fn, f'{arg} {key}', v, **_HPARAM_BOUNDS[key])
    elif arg in _HPARAM_BOUNDS:
      check_number(fn, arg, value, **_HPARAM_BOUNDS[arg])


def check_cohort(fn: str, cohort: Cohort) -> int:
  """Checks the cohort's fields against each other; returns the cohort size C."""
  for field in ('batches', 'mask', 'num_examples', 'client_ids'):
    if not hasattr(cohort, field):
      raise ValueError(f'{fn}: cohort has no field {field!r}; a cohort has '
                       'batches, mask, num_examples and client_ids.')
  mask = cohort.mask
  if jnp.ndim(mask) != 3:
    raise ValueError(f'{fn}: cohort.mask must have shape [C, S, B] '
                     f'(clients, steps, batch); got shape {jnp.shape(mask)}.')
  if not jnp.issubdtype(jnp.result_type(mask), jnp.bool_):
    raise ValueError(f'{fn}: cohort.mask must be boolean; got dtype '
                     f'{jnp.result_type(mask)}.')
  c = mask.shape[0]
  leaves = jax.tree_util.tree_leaves_with_path(cohort.batches,
                                               is_leaf=fedjx.indexed.is_indexed)
  if not leaves:
    raise ValueError(f'{fn}: cohort.batches holds no arrays.')
  for path, leaf in leaves:
    shape = leaf.shape if fedjx.indexed.is_indexed(leaf) else jnp.shape(leaf)
    if tuple(shape[:3]) != tuple(mask.shape):
      raise ValueError(
          f'{fn}: cohort.batches{jax.tree_util.keystr(path)} has shape '
          f'{shape}, whose leading [C, S, B] axes do not match '
          f'cohort.mask of shape {mask.shape}.')
  for field in ('num_examples', 'client_ids'):
    shape = jnp.shape(getattr(cohort, field))
    if shape != (c,):
      raise ValueError(f'{fn}: cohort.{field} must have shape [C] = ({c},) '
                       f'(one entry per client of cohort.mask); got {shape}.')
  return c


def check_client_states(fn: str, cohort: Cohort, c: int) -> None:
  """Checks that ``cohort.client_states`` holds one row per client."""
  rows = getattr(cohort, 'client_states', None)
  leaves = jax.tree_util.tree_leaves_with_path(rows)
  if rows is None or not leaves:
    raise ValueError(
        f'{fn}: cohort.client_states={rows!r}; this algorithm keeps per-client '
        'state outside the server state, so the cohort must carry its '
        'clients\' rows (leaves [C, ...]), e.g. from a ClientStore '
        '(docs/client_state.md).')
  for path, leaf in leaves:
    if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[0] != c:
      raise ValueError(
          f'{fn}: cohort.client_states{jax.tree_util.keystr(path)} has shape '
          f'{jnp.shape(leaf)}; its leading axis must be the cohort size {c}.')


def check_model(fn: str, loss_fn: LossFn, metrics_fn: MetricsFn | None,
                params: Params, cohort: Cohort) -> None:
  """Checks at trace time that ``loss_fn(params, batch)`` fits the cohort."""
  spec = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  batch = fedjx.indexed.batch_spec(cohort.batches)
  p = jax.tree.map(spec, params)
  b = cohort.mask.shape[2]
  shapes = lambda t: jax.tree.map(lambda s: tuple(s.shape), t)
  for name, f in (('loss_fn', loss_fn), ('metrics_fn', metrics_fn)):
    if f is None:
      continue
    try:
      out = jax.eval_shape(f, p, batch)
    except Exception as e:  # Re-raised with the shapes that did not fit.
      raise ValueError(
          f'{fn}: {name}(params, batch) fails for params of shapes '
          f'{shapes(p)} and a cohort batch of shapes {shapes(batch)} '
          f'(cohort.batches without the [C, S] axes): the params do not match '
          f'the cohort. {type(e).__name__}: {e}') from e
    leaves = [out] if name == 'loss_fn' else jax.tree.leaves(out)
    for leaf in leaves:
      if tuple(leaf.shape) != (b,):
        raise ValueError(f'{fn}: {name} must return per-example values of '
                         f'shape [B] = ({b},); got {shapes(out)}.')


# ------------------------------------------------------------ hyperparameters

def optimizer_hparams(optimizer: optax.GradientTransformation,
                      params: Params) -> dict[str, jax.Array]:
  """The traced hyperparameters of an ``optax.inject_hyperparams`` optimizer."""
  state = jax.eval_shape(optimizer.init, params)
  if not hasattr(state, 'hyperparams'):
    return {}
  return {k: jnp.asarray(v) for k, v in
          optimizer.init(params).hyperparams.items()}


def combine_hparams(fn: str, **parts: Mapping[str, Any]) -> dict[str, Any]:
  """``state.hparams`` from the entries of an algorithm's parts, one level.

  Each part (``algorithm=``, ``client_transform=``, ``aggregator=``) names
  its entries; a name two parts share would leave ``state.hparams`` one
  value for both (a client transform's ``clip_norm=0.001`` silently
  replaced by a DP aggregator's ``5.0``), so it is refused.
  """
  combined: dict[str, Any] = {}
  owner: dict[str, str] = {}
  for part, entries in parts.items():
    for key, value in entries.items():
      if key in combined:
        raise ValueError(
            f'{fn}: state.hparams[{key!r}] would be set by both the '
            f'{owner[key].replace("_", " ")} and the {part.replace("_", " ")}, '
            'and state.hparams holds one value per name; build one of them '
            'with fixed hyperparameters (without optax.inject_hyperparams) '
            'or give it another value name.')
      combined[key] = value
      owner[key] = part
  return combined


def hparam_names(optimizer: optax.GradientTransformation,
                 params: Params) -> tuple[str, ...]:
  """The names of an injected optimizer's hyperparameters (none if not injected)."""
  state = jax.eval_shape(optimizer.init, params)
  return tuple(getattr(state, 'hyperparams', {}))


def with_hparams(opt_state: optax.OptState,
                 hparams: Mapping[str, jax.Array]) -> optax.OptState:
  """Writes traced hyperparameters into an injected optimizer's state."""
  if not hparams:
    return opt_state
  old = opt_state.hyperparams
  new = dict(old)
  for k, v in hparams.items():
    new[k] = jnp.asarray(v, jnp.result_type(old[k]))
  return opt_state._replace(hyperparams=new)


def default_sgd(learning_rate: float, **kwargs: Any) -> optax.GradientTransformation:
  """``optax.sgd`` with traced (injected) hyperparameters."""
  static = ('nesterov',) if 'nesterov' in kwargs else ()
  return optax.inject_hyperparams(optax.sgd, static_args=static)(
      learning_rate=learning_rate, **kwargs)


# ------------------------------------------------------------ server helpers

def tree_sub(a: PyTree, b: PyTree) -> PyTree:
  """``a - b`` leaf by leaf: a client's update ``Delta_i = x - y_i``."""
  return jax.tree.map(jnp.subtract, a, b)


def aggregation_weights(num_examples: jax.Array, weighting: str) -> jax.Array:
  """Per-client aggregation weights ``w_i`` (a placed ``[C]`` array).

  ``'num_examples'``: ``w_i = n_i`` (McMahan et al. 2017);
  ``'uniform'``: ``w_i = 1`` for clients with data, 0 for padding clients.
  The weights are a differentiable function of ``cohort.num_examples``.
  """
  n = jnp.asarray(num_examples, jnp.float32)
  if weighting == 'num_examples':
    return n
  return (n > 0).astype(jnp.float32)


def server_update(optimizer: optax.GradientTransformation,
                  opt_state: optax.OptState, hparams: Mapping[str, jax.Array],
                  params: Params, pseudo_grad: PyTree) -> tuple[Params, optax.OptState]:
  """``params <- params + ServerOpt(pseudo_grad)`` with traced hyperparameters."""
  opt_state = with_hparams(opt_state, hparams)
  updates, opt_state = optimizer.update(pseudo_grad, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _replicated(tree: PyTree) -> PyTree:
  # Under an Explicit mesh, indexing a replicated store with client-sharded
  # ids is ambiguous; gather and scatter with replicated operands instead.
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or (
      jax.sharding.AxisType.Explicit not in mesh.axis_types):
    return tree
  return jax.tree.map(lambda x: jax.sharding.reshard(
      x, jax.sharding.PartitionSpec()), tree)


def gather_clients(store: PyTree, ids: jax.Array) -> PyTree:
  """Per-client state of the cohort: ``store[ids]`` for every leaf ``[N, ...]``."""
  ids = _replicated(jnp.asarray(ids, jnp.int32))
  return jax.tree.map(lambda a: a[ids], store)


def scatter_clients(store: PyTree, ids: jax.Array, values: PyTree,
                    real: jax.Array) -> PyTree:
  """``store[ids] = values`` for the clients with ``real`` True (others kept)."""
  leaves = jax.tree.leaves(store)
  if not leaves:
    return store
  n = leaves[0].shape[0]
  ids = _replicated(jnp.where(real, jnp.asarray(ids, jnp.int32), n))
  values = _replicated(values)
  return jax.tree.map(lambda a, v: a.at[ids].set(v, mode='drop'), store, values)


def round_metrics(stats: Mapping[str, jax.Array], num_examples: jax.Array,
                  **extra: jax.Array) -> Metrics:
  """Metrics of a round from the clients' placed statistics.

  ``stats`` are placed per-client sums from
  :func:`fedjx.algorithms.client_update.local_update`; the result pools them
  over the cohort (example-weighted means): ``train_loss_before`` (the server
  model on the cohort's training data), ``train_loss_after`` (each client's
  trained model on its own data), the same for every metric of
  ``metrics_fn`` (or, without client evaluation, ``train_loss_during``: the
  loss of the local steps), ``clients`` (participating clients, those with data) and
  ``examples``; ``extra`` scalars are added as given.
  """
  n = jnp.asarray(num_examples, jnp.float32)
  return pooled_metrics(stats, clients=fedjx.reduce_sum((n > 0).astype(jnp.float32)),
                        examples=fedjx.reduce_sum(n), **extra)


def client_metrics(update: PyTree, out: Any) -> dict[str, jax.Array]:
  """One client's own metrics (``client_metrics=True``), placed: ``[C]`` arrays.

  ``client_update_norm`` (``||Delta_i||_2`` of the update before the
  aggregator's encoding), ``client_num_steps`` (real local steps taken), and
  the client's mean loss on its own cohort data: ``client_loss_before`` /
  ``client_loss_after`` (at the server model and at the trained model) with
  client evaluation, else ``client_loss_during`` (over the local steps).
  A skipped (non-finite) client's values are 0.

  Args:
    update: the client's update ``Delta_i``.
    out: the client's :class:`fedjx.algorithms.client_update.ClientUpdate`.
  """
  count = jnp.maximum(out.stats['count'], 1.0)
  metrics = {'client_update_norm': optax.tree.norm(update).astype(jnp.float32),
             'client_num_steps': out.num_steps}
  for k in ('loss_before', 'loss_after', 'loss_during'):
    if k in out.stats:
      metrics[f'client_{k}'] = out.stats[k] / count
  return metrics


def pooled_metrics(stats: Mapping[str, jax.Array], *, clients: jax.Array,
                   examples: jax.Array, **extra: jax.Array) -> Metrics:
  """:func:`round_metrics` given the (already reduced) clients and examples."""
  sums = fedjx.reduce_sum(dict(stats))
  count = jnp.maximum(sums.pop('count'), 1.0)
  metrics = {f'train_{k}': v / count for k, v in sums.items()}
  metrics['clients'] = clients
  metrics['examples'] = examples
  metrics.update(extra)
  return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


# ---------------------------------------------------------------- assembling

def scan_rounds(apply: Callable[[Any, Cohort, jax.Array], tuple[Any, Metrics]],
                state: Any, cohorts: Cohort, keys: jax.Array) -> tuple[Any, Metrics]:
  """Runs ``R`` rounds with ``lax.scan``: one per leading entry of ``cohorts``.

  Cohorts of a population on the device stack their indices and share one
  table: ``batches = IndexedBatches(table, index)`` with ``index`` of shape
  ``[R, C, S, B]`` (the table is not scanned over).
  """
  table = (cohorts.batches.table if fedjx.indexed.is_indexed(
      getattr(cohorts, 'batches', None)) else None)
  if table is not None:
    cohorts = cohorts._replace(batches=cohorts.batches.index)

  def body(state, xs):
    cohort, key = xs
    if table is not None:
      cohort = cohort._replace(batches=fedjx.indexed.IndexedBatches(
          table, cohort.batches))
    return apply(state, cohort, key)
  return jax.lax.scan(body, state, (cohorts, keys))


@jax.jit
def _copy_all(xs: list[jax.Array]) -> list[jax.Array]:
  return [jnp.array(x, copy=True) for x in xs]


def _fresh_copy(tree: PyTree) -> PyTree:
  """``tree`` with every leaf in a new buffer of the same value, sharding and
  dtype, so donating the state never frees an array the caller still holds
  (e.g. the params passed to init).

  The arrays that share a placement (sharding and committedness) are copied
  by one program, compiled once per placement and shapes, rather than one
  program for each leaf's shape; other leaves (tracers, NumPy arrays,
  Python numbers) each by ``jnp.array(x, copy=True)``.
  """
  leaves, treedef = jax.tree.flatten(tree)
  out = list(leaves)
  groups: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      groups.setdefault((x.sharding, x.committed), []).append(i)
    else:
      out[i] = jnp.array(x, copy=True)
  for where in groups.values():
    for i, y in zip(where, _copy_all([leaves[i] for i in where])):
      out[i] = y
  return jax.tree.unflatten(treedef, out)


def make_algorithm(name: str, init: Callable[[Params], Any],
                   round_fn: Callable[[Any, Cohort, jax.Array], tuple[Any, Metrics]],
                   *, loss_fn: LossFn, metrics_fn: MetricsFn | None = None,
                   client_state_init: Callable[[Params], PyTree] | None = None,
                   traits: Traits = traits_lib.NONE) -> Algorithm:
  """Wraps an algorithm's ``init`` and round (a fedjx program body).

  ``round_fn`` is written with the fedjx primitives and called inside
  ``fedjx.program(clients=C, map_strategy=map_options)``, with ``C``
  the cohort size read from ``cohort.mask``. The execution options are those
  of :meth:`Algorithm.compile` (default ``'auto'``, no chunks, donating).
  ``loss_fn`` and ``metrics_fn`` are the model's, checked against the
  cohort before the first round.

  With ``client_state_init`` (see :class:`Algorithm`), ``round_fn`` reads
  ``cohort.client_states`` and returns ``(state, metrics, client_states)``.
  ``traits`` is the algorithm's declared record
  (:class:`fedjx.algorithms.traits.Traits`); with ``indexed_batches`` set
  ``round_fn`` reads an indexed cohort as it is, otherwise such a cohort's
  batches are gathered whole on the device before ``round_fn`` runs.
  """
  if client_state_init is not None and not callable(client_state_init):
    raise ValueError(f'{name}: client_state_init={client_state_init!r} must '
                     'be callable (params -> one client\'s initial state) or None.')
  if not callable(loss_fn):
    raise ValueError(f'{name}: loss_fn={loss_fn!r} must be callable.')
  if metrics_fn is not None and not callable(metrics_fn):
    raise ValueError(f'{name}: metrics_fn={metrics_fn!r} must be callable or None.')

  def init_state(params: Params) -> Any:
    if not jax.tree.leaves(params):
      raise ValueError(f'{name}: params={params!r} holds no arrays.')
    state = init(params)
    check_hparams(name, state.hparams)
    return _fresh_copy(state)

  def compiler(map_options: options.MapOptions, donate: bool) -> Algorithm:
    def apply(state: Any, cohort: Cohort, key: jax.Array) -> tuple[Any, Metrics]:
      c = check_cohort(name, cohort)
      if not traits.indexed_batches and fedjx.indexed.is_indexed(
          getattr(cohort, 'batches', None)):
        cohort = cohort._replace(batches=cohort.batches.dense())
      check_model(name, loss_fn, metrics_fn, state.params, cohort)
      if client_state_init is not None:
        check_client_states(name, cohort, c)
      program = fedjx.program(clients=c, map_strategy=map_options)
      return program(round_fn)(state, cohort, key)

    def run(state, cohorts, keys):
      if client_state_init is not None:
        raise ValueError(
            f'{name}: run_rounds is not available when clients keep state '
            'outside the server state (client_state_init is set): a client '
            'drawn in two rounds of one scan would read its state from before '
            'the scan. Run rounds one at a time, writing each round\'s '
            'client_states back (docs/client_state.md).')
      return scan_rounds(apply, state, cohorts, keys)

    apply.__name__ = f'{name}_round'
    run.__name__ = f'{name}_run_rounds'
    donated = (0,) if donate else ()
    return Algorithm(init=init_state,
                     round=constant_hoisting.jit(apply, donate_argnums=donated),
                     run_rounds=constant_hoisting.jit(run, donate_argnums=donated),
                     apply=apply, compiler=compiler,
                     client_state_init=client_state_init, traits=traits)

  return compiler(_DEFAULT_MAP, True)
