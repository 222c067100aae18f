"""How many clients an accelerator runs at once: the cost model of a chunk.

On a TPU or GPU, ``map_fn``'s ``auto`` strategy runs clients in vmapped
chunks of ``W`` members, the members ordered by their step counts
(:func:`fedjx.mapping.run_sorted`); each chunk takes one ``while`` loop over
the steps its largest member needs (:func:`fedjx.algorithms.client_update.
scan_steps`). One iteration of that loop, a local step of ``W`` members,
costs

    t(W) = L + W b,     b = max(TRAFFIC m / bandwidth, f / throughput)

where ``L`` is the latency of a loop iteration on the device (its small
kernels run one after another whatever their size), ``m`` the bytes of the
model a member trains (read by the forward pass, again by the backward
pass, and written by the update: ``TRAFFIC = 3`` passes) and ``f`` the
flops of one member's step. Sorted by step count, the chunks of a cohort
with ``sum(c)`` real member-steps and steps ``c_max``, ``c_min`` compute at
most ``sum(c) + W (c_max - c_min)`` member-steps in at most
``sum(c) / W + c_max`` iterations (each chunk's largest member is at most
the previous chunk's smallest), so the round costs about

    T(W) = L sum(c) / W + b sum(c) + (L + b W) (c_max - c_min):

wider chunks amortize the latency, and pay for padding; with ``S`` the
padded steps (``c_max - c_min < S``) and ``sum(c) = n c_mean``, ``T`` is
least at ``W* = sqrt(L n c_mean / (b S))``. The chunk's width is known
when the round is compiled, its cohort's step counts only when it runs, so
:func:`chunk_width` takes the narrowest power of two whose latency is at
most :data:`LATENCY_SHARE` of a chunk step (``L <= share (L + W b)``: no
wider, since a chunk's padding grows with ``W``), and no wider than the
power of two above ``W*`` for a cohort whose mean step count is
:data:`MEAN_STEPS_SHARE` of its padded steps (log-normal sizes of median
20 and sigma 0.8, in batches of 10, padded to a power of two: about a
tenth). A member whose own step already hides the latency (``W`` under
:data:`MIN_CHUNK`: a convolution or attention, which run poorly batched
over per-client weights) runs alone.

Measured on one TPU v5e chip (docs/benchmarks.md; McMahan's 2NN over 1,000
log-normal clients): one client at a time 0.031 s per round (``L + b``
about 10 us per step), vmapped chunks of 40 sorted clients 0.010 s, of 200
0.034 s, of 1,000 0.139 s. :data:`STEP_LATENCY_S` and the speeds of
:func:`device_speed` are from those and the vendors' figures; they are
what a measurement on a new device confirms.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from jax.extend import core as jex_core

# Latency of one iteration of a loop of small local steps, per backend. TPU:
# a scan over 1,000 2NN clients (3,054 steps) took 0.031 s, about 10 us per
# step, of which the 2NN's traffic (3 x 0.8 MB at 819 GB/s) is 3 us. GPU:
# not measured; a step launches some 20-40 kernels of a few microseconds.
STEP_LATENCY_S = {'tpu': 8e-6, 'gpu': 30e-6}
# Passes over a member's model per local step: the forward pass reads it,
# the backward pass reads it again, the update writes it.
TRAFFIC = 3
# A chunk is as narrow as keeps the loop's latency at most this share of a
# chunk step.
LATENCY_SHARE = 0.1
# Narrower chunks than this run their members one at a time.
MIN_CHUNK = 4
# The mean step count of a cohort, as a share of its padded steps, that the
# chunks' padding is weighed for.
MEAN_STEPS_SHARE = 1 / 8

# (memory bandwidth in bytes/s, throughput of a client's small float32
# products in flop/s), by device kind. The throughput is what small batched
# products reach, well under the chips' stated peaks: the EMNIST CNN's
# local step (1.3 GFLOP) took 0.38 ms on a TPU v5e, 3.5 TFLOP/s.
_SPEEDS = (
    ('v5 lite', (819e9, 20e12)), ('v5e', (819e9, 20e12)),
    ('v5p', (2.76e12, 40e12)), ('v6', (1.64e12, 40e12)), ('v4', (1.2e12, 25e12)),
    ('h200', (4.8e12, 50e12)), ('h100', (3.35e12, 50e12)),
    ('a100', (2.0e12, 20e12)))
_DEFAULT_SPEED = {'tpu': (819e9, 20e12), 'gpu': (2.0e12, 20e12)}


class StepCost(NamedTuple):
  """What one member's local step moves and computes.

  Attributes:
    model_bytes: bytes of the model a member trains (the values broadcast
      to the members).
    flops: flops of the member's matrix products and convolutions, each
      loop body counted once (:func:`loop_flops`): about one local step.
  """

  model_bytes: int
  flops: float


def device_speed(backend: str, device_kind: str = '') -> tuple[float, float]:
  """``(bandwidth, throughput)`` of a device (:data:`_SPEEDS` by its kind)."""
  kind = device_kind.lower()
  for name, speed in _SPEEDS:
    if name in kind:
      return speed
  return _DEFAULT_SPEED.get(backend, _DEFAULT_SPEED['gpu'])


def member_step_seconds(step: StepCost, backend: str, device_kind: str = '') -> float:
  """``b``: one member's share of a chunk step, bound by memory or by flops."""
  bandwidth, throughput = device_speed(backend, device_kind)
  return max(TRAFFIC * step.model_bytes / bandwidth, step.flops / throughput)


def chunk_width(n: int, step: StepCost, backend: str, device_kind: str = '') -> int:
  """The members a chunk of ``n`` runs at once on an accelerator (1: alone).

  The narrowest power of two ``W`` with ``L <= LATENCY_SHARE (L + W b)``,
  and at most the power of two at or above ``sqrt(L n MEAN_STEPS_SHARE /
  b)`` (the module's ``W*``) and ``n``; 1 where the first is under
  :data:`MIN_CHUNK`.
  """
  latency = STEP_LATENCY_S.get(backend, STEP_LATENCY_S['gpu'])
  b = max(member_step_seconds(step, backend, device_kind), 1e-12)
  wanted = (1 / LATENCY_SHARE - 1) * latency / b
  if wanted < MIN_CHUNK:
    return 1
  padding = math.sqrt(latency * n * MEAN_STEPS_SHARE / b)
  width = min(wanted, padding)
  return max(1, min(1 << math.ceil(math.log2(max(width, 1))), n))


def loop_flops(jaxpr: Any) -> float:
  """Flops of the matrix products and convolutions of ``jaxpr``, the body
  of every loop counted once and the costliest branch of a ``cond``.

  For a member's computation (its local steps in a loop): about the flops
  of one local step, plus one batch of each evaluation pass.
  """
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == 'dot_general':
      (contract, _), _ = eqn.params['dimension_numbers']
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * float(
          np.prod([lhs[d] for d in contract]))
    elif name == 'conv_general_dilated':
      rhs = eqn.invars[1].aval.shape
      out_features = rhs[eqn.params['dimension_numbers'].rhs_spec[0]]
      total += 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * float(
          np.prod(rhs)) / out_features
    subs = [getattr(j, 'jaxpr', j) for j in jex_core.jaxprs_in_params(eqn.params)]
    if subs:
      each = [loop_flops(j) for j in subs]
      total += max(each) if name == 'cond' else sum(each)
  return total


__all__ = ['StepCost', 'chunk_width', 'device_speed', 'loop_flops',
           'member_step_seconds']
