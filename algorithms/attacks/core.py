"""Model poisoning: a fixed set of malicious clients whose messages are replaced.

A fraction of the population is malicious: a set ``M`` of client ids drawn
once from a seed (:func:`malicious_clients`), so that each round's number of
malicious clients is that of the sampled cohort's intersection with ``M``.
An attack is a part on the aggregator's side (:func:`attacked`): it wraps the
algorithm's aggregator, and its ``combine``

    1. flags the cohort's clients ``a_i = 1[id_i in M and n_i > 0]`` (padding
       clients, ``n_i = 0``, and clients the non-finite guard skipped, whose
       ``n_i`` it zeroed, are never malicious votes);
    2. for an omniscient attack, computes the honest participants'
       coordinate-wise statistics of their updates ``Delta_i`` with the
       fedjx reductions, ``h_i = 1[n_i > 0] (1 - a_i)``, ``H = sum_i h_i``,
       ``mu = sum_i h_i Delta_i / H``, ``sigma^2 = sum_i h_i (Delta_i -
       mu)^2 / H``;
    3. replaces each malicious client's message ``m_i = Enc(Delta_i)`` by
       ``Enc(P(Delta_i, mu, sigma))``, the attack's poisoned update ``P``
       passed through the wrapped aggregator's own ``encode`` (as an honest
       update is: a DP aggregator clips it, a quantizer quantizes it, a
       norm-bounding defense bounds it, centered clipping clips it around
       its centre; the attacker controls what it computes, not the protocol
       that encodes it);
    4. calls the wrapped aggregator's ``combine`` on the poisoned cohort.

The attack acts on the update, never on a message: a message need not be an
update (centered clipping's is ``clip_tau(Delta_i - v)``, a compressor's its
codes), and ``Enc(P(Enc(Delta_i)))`` would encode twice (subtract the
centre twice). When the wrapped aggregator encodes, the attacked one's
``encode`` therefore also keeps each client's update beside the wrapped
``encode``'s values (``encoded = (e_i, Delta_i)``, one more copy of the
update per client), and ``combine`` reads it there.

So an attack composes with every algorithm that passes its cohort's
``client_ids`` to its aggregator (FedAvg and FedOpt, FedProx, SCAFFOLD,
DiLoCo), with every aggregator (the mean, the robust rules, DP, quantized
means) and with every map strategy, and stays a MapReduce program. The
malicious set lives in the aggregator's state (``AttackState.malicious``, a
``bool [N]`` table), so runs of different seeds share one compiled round
(sweeps vectorize them). The round's metrics gain ``malicious_clients``,
``sum_i a_i``.

Attacks (``P`` for a malicious client's update ``Delta_i``; ``n`` the round's
participants, ``f`` its malicious ones):

| attack | ``P`` | paper |
|---|---|---|
| :func:`sign_flip` | ``-s Delta_i`` | reversed gradients (Damaskinos et al. 2018; Li et al. 2019, RSA) |
| :func:`gaussian_noise` | ``Delta_i + sigma xi_i``, ``xi_i ~ N(0, I)`` | Gaussian Byzantine workers (Blanchard et al. 2017) |
| :func:`scaling` | ``gamma Delta_i`` (``gamma = n`` by default) | model replacement (Bagdasaryan et al. 2020) |
| :func:`alie` | ``mu - z sigma`` | "A little is enough" (Baruch et al. 2019) |
| :func:`ipm` | ``-epsilon mu`` | inner-product manipulation (Xie et al. 2020) |
| :func:`identity` | ``Delta_i`` | (data poisoning: only counts the malicious) |

Each attack's numbers are traced hyperparameters in ``state.hparams``
(``attack_scale``, ``attack_sigma``, ``attack_boost``, ``attack_z``,
``attack_epsilon``).
"""

from __future__ import annotations

import fractions
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy import special

import fedjx
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import base
from fedjx.algorithms.traits import Traits

METRIC = 'malicious_clients'
# The stream of the malicious set's draw, and of the attack's noise (folded
# into the round key, which the wrapped aggregator receives unchanged).
_MALICIOUS_STREAM = 0x4D414C49
_NOISE_STREAM = 0x41545441


class Honest(NamedTuple):
  """What an attack may read of the round, on the server (unplaced).

  Attributes:
    mean: ``mu``, the honest participants' coordinate-wise mean update
      (None unless the attack is omniscient).
    std: ``sigma``, their coordinate-wise standard deviation (population
      form, divided by ``H``; None unless omniscient).
    participants: ``n``, the clients with data in the round (honest and
      malicious).
    malicious: ``f``, the round's malicious participants.
  """

  mean: base.PyTree
  std: base.PyTree
  participants: jax.Array
  malicious: jax.Array


Poison = Callable[[Mapping[str, jax.Array], Honest, base.PyTree, jax.Array],
                  base.PyTree]


class Attack(NamedTuple):
  """A model-poisoning rule: what a malicious client sends instead.

  Attributes:
    name: the attack's name (for messages).
    poison: ``poison(hparams, honest, update, key) -> poisoned``, for one
      malicious client (inside ``fedjx.map_fn``): ``hparams`` the attack's
      traced hyperparameters, ``honest`` the round's :class:`Honest`
      statistics, ``update`` the client's own update ``Delta_i`` and ``key``
      its PRNG key for the round.
    hparams: the attack's initial traced hyperparameters, by name
      (top-level keys of ``state.hparams``).
    metrics: ``metrics(hparams, honest) -> {name: scalar}``, extra round
      metrics, or None.
    traits: what the attack declares (:class:`fedjx.algorithms.traits.Traits`):
      ``omniscient``, whether ``poison`` reads ``honest.mean`` and
      ``honest.std`` (they are computed only then).
  """

  name: str
  poison: Poison
  hparams: Mapping[str, float] = {}
  metrics: Callable[[Mapping[str, jax.Array], Honest], base.Metrics] | None = None
  traits: Traits = Traits()


class AttackState(NamedTuple):
  """The state of an attacked aggregator.

  Attributes:
    inner: the wrapped aggregator's state.
    malicious: ``bool [N]``, True for the population's malicious clients.
  """

  inner: Any
  malicious: jax.Array


def _scaled(tree: base.PyTree, factor: jax.Array) -> base.PyTree:
  return jax.tree.map(lambda t: t * jnp.asarray(factor, t.dtype), tree)


# ---------------------------------------------------------------- the set

def malicious_count(num_clients: int, fraction: float) -> int:
  """``floor(fraction N + 1/2)`` in exact arithmetic on ``fraction``'s decimal
  (:func:`malicious_clients`)."""
  exact = fractions.Fraction(repr(float(fraction))) * int(num_clients)
  return int(math.floor(exact + fractions.Fraction(1, 2)))


def malicious_clients(num_clients: int, fraction: float, seed: int) -> np.ndarray:
  """``int32 [F]``: the sorted ids of ``F`` malicious clients of ``N``.

  ``F = floor(fraction N + 1/2)``: the nearest count, halves rounded up,
  with ``fraction`` taken as the decimal it is written as (``0.29`` is
  29/100, not its binary float, whose product with 50 falls just below
  14.5). So 0.25 of 10 clients is 3 (Python's ``round(2.5)`` would give 2),
  0.24 of 10 is 2, 0.05 of 10 is 1, 0.04 of 10 is 0 (no malicious client),
  0.29 of 50 is 15.

  Drawn uniformly without replacement from ``0 .. N - 1`` by a generator
  seeded with ``(seed, stream)`` only: the same set for the same seed,
  whatever else the run does.
  """
  fn = 'malicious_clients'
  if isinstance(num_clients, bool) or not isinstance(
      num_clients, (int, np.integer)) or num_clients < 1:
    raise ValueError(f'{fn}: num_clients={num_clients!r}; it must be an int >= 1.')
  base.check_number(fn, 'fraction', fraction, high=1.0)
  if fraction >= 1:
    raise ValueError(f'{fn}: fraction={fraction!r}; it must be in [0, 1) '
                     '(some clients must be honest).')
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f'{fn}: seed={seed!r}; it must be an int >= 0.')
  count = malicious_count(num_clients, fraction)
  rng = np.random.default_rng(np.random.SeedSequence([_MALICIOUS_STREAM, int(seed)]))
  return np.sort(rng.choice(num_clients, size=count, replace=False)).astype(np.int32)


# ---------------------------------------------------------------- attacks

def identity() -> Attack:
  """``P = Delta_i``: malicious clients send what they computed.

  For data poisoning (:mod:`fedjx.datasets.poisoning`), whose malicious
  clients train honestly on poisoned data: the wrapper only counts them
  (``malicious_clients``).
  """
  return Attack('identity', lambda hparams, honest, m, key: m)


def sign_flip(scale: float = 1.0) -> Attack:
  """``P = -s Delta_i``: the update reversed (and scaled by ``s = scale``).

  The reversed-gradient Byzantine worker of Damaskinos et al., "Asynchronous
  Byzantine Machine Learning", ICML 2018, and the sign-flipping attack of
  Li et al., "RSA: Byzantine-Robust Stochastic Aggregation Methods", AAAI
  2019. With equal weights and ``s = 1`` the mean of ``n`` updates of which
  ``f`` are flipped is ``(1 - 2 f / n)`` times the honest mean (a slower
  descent); with ``s > n / f - 1`` it points uphill. ``s`` is
  ``state.hparams['attack_scale']``.
  """
  base.check_number('sign_flip', 'scale', scale)
  return Attack('sign_flip',
                lambda hp, honest, m, key: _scaled(m, -hp['attack_scale']),
                hparams={'attack_scale': scale})


def gaussian_noise(sigma: float = 1.0) -> Attack:
  """``P = Delta_i + sigma xi_i``, ``xi_i ~ N(0, I)`` fresh for each client and round.

  The Gaussian Byzantine workers of Blanchard, El Mhamdi, Guerraoui,
  Stainer, "Machine Learning with Adversaries: Byzantine Tolerant Gradient
  Descent", NeurIPS 2017 (Section 5), who send ``N(0, sigma^2 I)``; here the
  noise is added to the client's own update (the two agree when ``sigma``
  dwarfs the update). ``xi_i`` is drawn from the round's key folded with the
  attack's stream and the client's id, one key per leaf. ``sigma`` is
  ``state.hparams['attack_sigma']``.
  """
  base.check_number('gaussian_noise', 'sigma', sigma)

  def poison(hp, honest, m, key):
    return aggregators.add_gaussian_noise(m, hp['attack_sigma'], key)

  return Attack('gaussian_noise', poison, hparams={'attack_sigma': sigma})


def scaling(boost: float | None = None) -> Attack:
  """``P = gamma Delta_i``: the boosted update of model replacement.

  Bagdasaryan, Veit, Hua, Estrin, Shmatikov, "How To Backdoor Federated
  Learning", AISTATS 2020, Section 4: an attacker who wants the global
  model to become its own ``X`` sends ``gamma (X - G^t)`` with
  ``gamma = n / eta`` (``n`` participants, server learning rate ``eta``), so
  that the average of its update with the others' (which nearly cancel
  near convergence) replaces the model. ``boost=None`` takes ``gamma = n``,
  the round's participants (model replacement under equal weights and
  ``eta = 1``); a number fixes ``gamma`` (``state.hparams['attack_boost']``).
  With a backdoor in the malicious clients' data
  (:func:`fedjx.datasets.poisoning.backdoor`) this is the paper's attack.
  """
  if boost is None:
    return Attack('scaling',
                  lambda hp, honest, m, key: _scaled(m, honest.participants))
  base.check_number('scaling', 'boost', boost)
  return Attack('scaling', lambda hp, honest, m, key: _scaled(m, hp['attack_boost']),
                hparams={'attack_boost': boost})


def alie_z(participants: jax.Array, malicious: jax.Array) -> jax.Array:
  """``z_max`` of "A little is enough": ``Phi^-1((n - s) / n)``, ``s = floor(n/2 + 1) - f``.

  Baruch, Baruch, Goldberg 2019, Algorithm 3: ``s`` is the number of honest
  workers the attackers need on their side for a majority; ``z_max`` the
  largest ``z`` with ``Phi(z) < (n - s) / n`` (``Phi`` the standard normal
  CDF). ``s`` is kept >= 1 (with a malicious majority the formula's
  ``s <= 0`` would give an infinite ``z``) and ``n >= 1``.
  """
  n = jnp.maximum(jnp.asarray(participants, jnp.float32), 1.0)
  f = jnp.asarray(malicious, jnp.float32)
  s = jnp.maximum(jnp.floor(n / 2 + 1) - f, 1.0)
  return special.ndtri((n - s) / n)


def alie(z: float | None = None) -> Attack:
  """``P = mu - z sigma`` coordinate-wise: "A little is enough".

  Baruch, Baruch, Goldberg, "A Little Is Enough: Circumventing Defenses For
  Distributed Learning", NeurIPS 2019: every malicious client sends the
  honest mean moved by ``z`` honest standard deviations in each coordinate,
  small enough to hide among the honest updates (so the median, trimmed
  mean and Krum keep it) and, repeated by every attacker, enough to steer
  the model. ``z=None`` takes the paper's ``z_max`` from the round's ``n``
  and ``f`` (:func:`alie_z`); a number fixes it
  (``state.hparams['attack_z']``). ``mu`` and ``sigma`` are the honest
  participants' (module docstring); the metric ``attack_z`` is the ``z``
  used.
  """
  if z is not None:
    base.check_number('alie', 'z', z, low=-math.inf)

  def z_of(hp, honest):
    if z is None:
      return alie_z(honest.participants, honest.malicious)
    return hp['attack_z']

  def poison(hp, honest, m, key):
    zz = z_of(hp, honest)
    return jax.tree.map(lambda mu, sd: mu - jnp.asarray(zz, mu.dtype) * sd,
                        honest.mean, honest.std)

  return Attack('alie', poison, hparams={} if z is None else {'attack_z': z},
                metrics=lambda hp, honest: {'attack_z': z_of(hp, honest)},
                traits=Traits(omniscient=True))


def ipm(epsilon: float = 0.1) -> Attack:
  """``P = -epsilon mu``: inner-product manipulation.

  Xie, Koyejo, Gupta, "Fall of Empires: Breaking Byzantine-tolerant SGD by
  Inner Product Manipulation", UAI 2019 (PMLR 115, 2020): every malicious
  client sends the honest mean reversed and scaled by ``epsilon``, so that
  the aggregate's inner product with the true gradient turns negative. A
  small ``epsilon`` (0.1, the paper's choice against the median and Krum)
  hides the attackers near the honest cluster; a large one (the paper's
  100) defeats the mean. ``epsilon`` is ``state.hparams['attack_epsilon']``.
  """
  base.check_number('ipm', 'epsilon', epsilon)
  return Attack('ipm', lambda hp, honest, m, key: _scaled(honest.mean,
                                                          -hp['attack_epsilon']),
                hparams={'attack_epsilon': epsilon},
                traits=Traits(omniscient=True))


# ---------------------------------------------------------------- the wrapper

def _key_data(key: jax.Array) -> jax.Array:
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key)
  return key


def _honest_statistics(update: base.PyTree, honest: jax.Array,
                       count: jax.Array) -> tuple[base.PyTree, base.PyTree]:
  """``(mu, sigma)`` of the updates of the clients with ``honest = 1``."""
  denom = jnp.maximum(count, 1.0)
  total = fedjx.reduce_sum(fedjx.map_fn(
      lambda m, h: jax.tree.map(lambda x: h.astype(x.dtype) * x, m),
      (update, honest)))
  mean = jax.tree.map(lambda t: t / denom.astype(t.dtype), total)
  squares = fedjx.reduce_sum(fedjx.map_fn(
      lambda m, h, mu: jax.tree.map(
          lambda x, c: h.astype(x.dtype) * jnp.square(x - c), m, mu),
      (update, honest, fedjx.broadcast(mean))))
  std = jax.tree.map(lambda s: jnp.sqrt(s / denom.astype(s.dtype)), squares)
  return mean, std


def attacked(aggregator: aggregators.Aggregator, attack: Attack,
             malicious: Sequence[int] | np.ndarray,
             num_clients: int) -> aggregators.Aggregator:
  """``aggregator`` whose malicious clients' messages ``attack`` replaces.

  See the module docstring for the four steps of its ``combine``.

  Args:
    aggregator: the algorithm's aggregator (any
      :class:`~fedjx.algorithms.aggregators.Aggregator`, or None for the mean).
    attack: an :class:`Attack` (e.g. :func:`sign_flip`).
    malicious: the malicious client ids (e.g. :func:`malicious_clients`),
      each in ``[0, num_clients)``.
    num_clients: ``N``, the training population's size.

  Returns:
    An aggregator with state :class:`AttackState` and the attack's
    hyperparameters added to the wrapped one's; its round metrics add
    ``malicious_clients`` (and the attack's own).
  """
  fn = 'attacked'
  inner = aggregators.check(fn, aggregator)
  if not isinstance(attack, Attack):
    raise ValueError(f'{fn}: attack={attack!r} is not a '
                     'fedjx.algorithms.attacks.Attack (e.g. sign_flip()).')
  if isinstance(num_clients, bool) or not isinstance(
      num_clients, (int, np.integer)) or num_clients < 1:
    raise ValueError(f'{fn}: num_clients={num_clients!r}; it must be an int >= 1.')
  ids = np.asarray(malicious, np.int64).reshape(-1)
  if ids.size and (ids.min() < 0 or ids.max() >= num_clients):
    bad = ids[(ids < 0) | (ids >= num_clients)][0]
    raise ValueError(f'{fn}: malicious holds client id {int(bad)}; ids must be '
                     f'in [0, {num_clients}).')
  table = np.zeros(num_clients, bool)
  table[ids] = True
  clash = sorted(set(attack.hparams) & set(inner.hparams))
  if clash:
    raise ValueError(f'{fn}: the attack\'s hyperparameters {clash} have the '
                     'names of the aggregator\'s.')
  inner_encode = inner.encode

  def encode(hparams, update, w):
    message, encoded = inner_encode(hparams, update, w)
    return message, (encoded, update)

  def init(params):
    return AttackState(inner.init(params), jnp.asarray(table))

  def combine(state, hparams, clients, key):
    if clients.client_ids is None:
      raise ValueError(
          f'{fn}: the round passed no client ids to its aggregator '
          '(clients.client_ids is None), so the malicious clients cannot be '
          'told apart; use an algorithm that passes them (fedavg and its '
          'variants, scaffold, diloco).')
    inner_hp = {k: hparams[k] for k in inner.hparams}
    attack_hp = {k: hparams[k] for k in attack.hparams}

    def flag(cid, n, table):
      # table[cid] without a gather (which a clients-sharded mesh cannot
      # place: the index is sharded, the table replicated); a padding id
      # (-1) matches no entry.
      i = jnp.asarray(cid, jnp.int32)
      member = jnp.any(table & (jnp.arange(table.shape[0], dtype=jnp.int32) == i))
      active = n > 0
      return (jnp.asarray(member & active, jnp.float32),
              jnp.asarray(active, jnp.float32))

    bad, active = fedjx.map_fn(flag, (clients.client_ids, clients.num_examples,
                                      fedjx.broadcast(state.malicious)))
    participants = fedjx.reduce_sum(active)
    f = fedjx.reduce_sum(bad)
    # The clients' updates: kept by encode beside its values, or the messages
    # themselves when the wrapped aggregator sends the update as it is.
    if inner_encode is None:
      inner_encoded, updates = clients.encoded, clients.update
    else:
      inner_encoded, updates = clients.encoded
    mean = std = None
    if attack.traits.omniscient:
      mean, std = _honest_statistics(updates, active - bad, participants - f)
    honest = Honest(mean, std, participants, f)
    encode_hp = dict(inner_hp)
    if inner.broadcast is not None:
      encode_hp.update(inner.broadcast(state.inner))
    noise_key = jax.random.fold_in(key, _NOISE_STREAM)
    guarded = clients.weighted_update is not None

    # Per-client values the wrapped encode reads (a compressor's key, ...).
    placed = aggregators.client_inputs(inner, state.inner, clients.client_ids,
                                       clients.num_examples)

    def replace(a, cid, w, m, update, weighted, encoded, hp, enc_hp, own, stats,
                key_data):
      k = jax.random.fold_in(jax.random.wrap_key_data(key_data),
                             jnp.maximum(jnp.asarray(cid, jnp.int32), 0))
      poisoned = attack.poison(hp, stats, update, k)
      if inner_encode is not None:
        poisoned, new_encoded = inner_encode(dict(enc_hp, **own), poisoned, w)
      else:
        new_encoded = encoded
      take = a > 0
      pick = lambda new, old: jax.tree.map(
          lambda x, y: jnp.where(take, x.astype(y.dtype), y), new, old)
      out_weighted = (pick(jax.tree.map(lambda x: w.astype(x.dtype) * x, poisoned),
                           weighted) if guarded else ())
      return pick(poisoned, m), out_weighted, pick(new_encoded, encoded)

    update, weighted, encoded = fedjx.map_fn(replace, (
        bad, clients.client_ids, clients.weights, clients.update, updates,
        clients.weighted_update if guarded else (), inner_encoded,
        fedjx.broadcast(attack_hp), fedjx.broadcast(encode_hp), placed,
        fedjx.broadcast(honest), fedjx.broadcast(_key_data(noise_key))))
    poisoned = clients._replace(update=update, encoded=encoded,
                                weighted_update=weighted if guarded else None)
    aggregate, inner_state, metrics = inner.combine(state.inner, inner_hp,
                                                    poisoned, key)
    metrics = dict(metrics, **{METRIC: f})
    if attack.metrics is not None:
      metrics.update(attack.metrics(attack_hp, honest))
    return aggregate, AttackState(inner_state, state.malicious), metrics

  broadcast = None if inner.broadcast is None else (
      lambda state: inner.broadcast(state.inner))
  inputs = None if inner.client_inputs is None else (
      lambda state, ids, size: inner.client_inputs(state.inner, ids, size))
  return inner._replace(init=init, combine=combine, broadcast=broadcast,
                        client_inputs=inputs,
                        encode=None if inner_encode is None else encode,
                        hparams={**inner.hparams, **attack.hparams})


__all__ = ['Attack', 'AttackState', 'Honest', 'METRIC', 'alie',
           'alie_z', 'attacked', 'gaussian_noise', 'identity', 'ipm',
           'malicious_clients', 'malicious_count', 'scaling', 'sign_flip']
