"""Synthetic(alpha, beta): the heterogeneous logistic data of FedProx and LEAF.

Li et al. 2020, "Federated Optimization in Heterogeneous Networks" (FedProx),
Section 5.1, and the LEAF benchmark (Caldas et al. 2018). Client ``k`` has a
softmax-regression model and its own input distribution:

* ``u_k ~ N(0, alpha)``, ``W_k ~ N(u_k, 1)`` (``[d, K]``), ``b_k ~ N(u_k, 1)``;
* ``B_k ~ N(0, beta)``, ``v_k ~ N(B_k, 1)`` (``[d]``);
* ``x ~ N(v_k, Sigma)`` with ``Sigma`` diagonal, ``Sigma_jj = j^-1.2``;
* ``y = argmax(softmax(x W_k + b_k))``.

``alpha`` controls how much the local models differ, ``beta`` how much the
local inputs differ. As in the papers' generator, ``alpha`` and ``beta`` are
used as standard deviations. Client sizes are ``floor(LogNormal(4, 2)) + 50``
(optionally capped). With ``iid=True`` every client shares one ``W, b`` drawn
from ``N(0, 1)`` and ``x ~ N(0, Sigma)`` (the papers' Synthetic-IID).

Clients are generated on demand from ``(seed, client_id)``: only the sizes
(one int per client) are held, so populations of millions are cheap.
"""

from __future__ import annotations

import numpy as np

from fedjx.datasets import _seeding
from fedjx.datasets.federated import Examples, FederatedDataset


class SyntheticDataset(FederatedDataset):
  """Synthetic(alpha, beta) clients, generated from ``(seed, client_id)``."""

  def __init__(self, alpha: float, beta: float, num_clients: int, seed: int = 0,
               iid: bool = False, dim: int = 60, num_classes: int = 10,
               size_mean: float = 4.0, size_sigma: float = 2.0,
               min_examples: int = 50, max_examples: int | None = None):
    for name, value in (('alpha', alpha), ('beta', beta)):
      if not np.isfinite(value) or value < 0:
        raise ValueError(f'synthetic: {name}={value!r}; it must be a float >= 0.')
    for name, value in (('num_clients', num_clients), ('dim', dim),
                        ('num_classes', num_classes), ('min_examples', min_examples)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f'synthetic: {name}={value!r}; it must be an int >= 1.')
    if max_examples is not None and max_examples < min_examples:
      raise ValueError(f'synthetic: max_examples={max_examples!r}; it must be None '
                       f'or >= min_examples={min_examples}.')
    self.alpha, self.beta, self.seed, self.iid = float(alpha), float(beta), seed, iid
    self.dim, self.num_classes = int(dim), int(num_classes)
    gen = _seeding.rng(_seeding.SYNTHETIC_SIZES, seed)
    sizes = gen.lognormal(size_mean, size_sigma, int(num_clients))
    sizes = np.floor(np.minimum(sizes, 2.0**62)).astype(np.int64) + min_examples
    if max_examples is not None:
      sizes = np.minimum(sizes, max_examples)
    self._sizes = sizes
    self._std = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)

  @property
  def num_clients(self) -> int:
    return int(self._sizes.shape[0])

  def num_examples(self, cid: int) -> int:
    return int(self._sizes[self.check_client(cid)])

  def examples_per_client(self) -> np.ndarray:
    return self._sizes.copy()

  def client_model(self, cid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Client ``cid``'s ``(W [d, K], b [K], v [d])``: its labelling model and input mean."""
    cid = self.check_client(cid)
    d, k = self.dim, self.num_classes
    if self.iid:
      gen = _seeding.rng(_seeding.SYNTHETIC_GLOBAL, self.seed)
      return gen.normal(0, 1, (d, k)), gen.normal(0, 1, k), np.zeros(d)
    gen = _seeding.rng(_seeding.SYNTHETIC_CLIENT, self.seed, cid)
    u = gen.normal(0, self.alpha)
    big_b = gen.normal(0, self.beta)
    w = gen.normal(u, 1, (d, k))
    b = gen.normal(u, 1, k)
    v = gen.normal(big_b, 1, d)
    return w, b, v

  def _client_data(self, cid: int) -> Examples:
    w, b, v = self.client_model(cid)
    gen = _seeding.rng(_seeding.SYNTHETIC_CLIENT, self.seed, cid, 1)
    n = int(self._sizes[cid])
    x = v + gen.standard_normal((n, self.dim)) * self._std
    y = np.argmax(x @ w + b, axis=1)
    return {'x': x.astype(np.float32), 'y': y.astype(np.int32)}


def synthetic(alpha: float, beta: float, num_clients: int = 30, seed: int = 0,
              iid: bool = False, **kwargs) -> SyntheticDataset:
  """The Synthetic(alpha, beta) population of FedProx (Li et al. 2020).

  ``synthetic(0, 0)``, ``synthetic(0.5, 0.5)`` and ``synthetic(1, 1)`` are the
  paper's settings (30 clients); ``iid=True`` is Synthetic-IID. Features:
  ``'x'`` float32 ``[dim]`` (60), ``'y'`` int32 in ``[0, num_classes)`` (10).
  Keyword arguments (``dim``, ``num_classes``, ``size_mean``, ``size_sigma``,
  ``min_examples``, ``max_examples``) go to :class:`SyntheticDataset`.
  """
  return SyntheticDataset(alpha, beta, num_clients, seed, iid, **kwargs)
