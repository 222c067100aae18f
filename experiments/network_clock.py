"""Each round's simulated wall clock and compute utilization (``config.network``).

With ``config.network.bandwidth_gbps`` set, every training round's metrics
row gains, from the communication model of :mod:`fedjx.experiments.network`
(the one ``fedjx-plan --schedule`` prints, built by the same
:func:`fedjx.experiments.network.from_flags`):

* ``simulated_round_s``: the round's compute plus the communication that
  compute does not hide;
* ``simulated_step_s``: that over the round's inner steps;
* ``compute_utilization``: compute / (compute + exposed communication);
* ``simulated_elapsed_s``: the running sum of ``simulated_round_s``
  (carried across checkpoints).

Without it nothing is added and the rows are those of a run without the
section.

**Bytes.** ``communicated_bytes`` of DiLoCo and Streaming DiLoCo
(:func:`fedjx.algorithms.aggregators.upload_bytes`) is what *all* the
round's replicas with data uploaded together: ``clients`` times one
replica's message (its wire bits over 8 for a compressing aggregator). The
all-reduce the model charges reduces one replica's message, so the payload
is ``communicated_bytes / clients``, reduced between ``clients`` replicas
(the round's ``clients`` metric: replicas with data). With
``config.network.wire_bytes`` set the payload is instead the model's
parameter count times it; a round that reports no ``communicated_bytes``
(the FedAvg family) sends its aggregator's ``upload_bits`` over 8 (the mean
message of the clients with data) where it reports them, else the bytes of
the model's parameters as stored (float32: 4 bytes a parameter, an
uncompressed mean's message).

**Schedule.** ``H`` is ``config.network.inner_steps``, else
``config.local_steps``.

* DiLoCo and the FedAvg family (one reduction of the whole update per
  round): ``Schedule.diloco(H, overlap_fraction, layers)`` with the
  section's ``overlap_fraction`` (0: blocking) and ``layers``.
* Streaming DiLoCo (an algorithm with ``num_fragments``): a round of
  ``H`` steps sends one of the ``P`` fragments, so the model's schedule,
  in which every fragment is reduced once, spans ``P`` rounds:
  ``Schedule.streaming_diloco(P H, P, tau)`` with ``P = num_fragments``,
  ``tau = overlap_steps`` (the algorithm's config, else its builder's
  defaults) and the payload of the whole model, ``P`` times this round's
  fragment (the round's own bytes scaled to the model; fragments of unequal
  size are each charged as if all were its size). ``simulated_round_s`` is
  the model's round over ``P``; step time and utilization are the model's.
* DiLoCo with a 1-outer-step overlap (an algorithm with ``outer_update``:
  ``eager_diloco``, eager or delayed): the outer gradient's all-reduce runs
  during the next round's ``H`` inner steps, ``Schedule.streaming_diloco(H,
  1, H)`` (exposed ``max(0, t(S) - H T)``).

**Step time.** ``config.network.step_seconds``, or, when None (the
default: the run's own hardware is the compute the model should charge,
and nothing has to be guessed), measured: the round's wall seconds, from its
dispatch to its metrics on the host, over ``H``. The round a process runs
first also compiles its program, so with a measured step time that round
has no simulated metrics (its wall time is not compute) and
``simulated_elapsed_s`` starts at the next; give ``step_seconds`` for a
clock that is a function of the round's bytes alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from fedjx.experiments import network
from fedjx.experiments import registry
from fedjx.experiments.errors import ConfigError

METRICS = ('simulated_round_s', 'simulated_step_s', 'compute_utilization',
           'simulated_elapsed_s')
"""What each round's row gains."""

FLOAT32_BYTES = 4


def schedule_knobs(config: Any) -> dict[str, Any]:
  """``plan_cli``'s schedule flags for ``config`` (H, P, tau, o, L; the rules above)."""
  section = config.network
  h = section['inner_steps'] or config.local_steps
  name, kwargs = registry.split_name('algorithm', config.algorithm)
  options = registry.builder_options(name)
  if 'num_fragments' in options:
    value = lambda key: kwargs.get(key, options[key].default)
    p, tau = int(value('num_fragments')), value('overlap_steps')
    return dict(schedule='streaming_diloco', inner_steps=p * h, fragments=p,
                overlap_steps=float(tau), overlap_fraction=section['overlap_fraction'],
                layers=section['layers'], rounds_per_schedule=p)
  if 'outer_update' in options:  # The 1-outer-step overlap: hidden behind H steps.
    return dict(schedule='streaming_diloco', inner_steps=h, fragments=1,
                overlap_steps=float(h), overlap_fraction=section['overlap_fraction'],
                layers=section['layers'], rounds_per_schedule=1)
  return dict(schedule='diloco', inner_steps=h, fragments=1, overlap_steps=0.0,
              overlap_fraction=section['overlap_fraction'], layers=section['layers'],
              rounds_per_schedule=1)


class NetworkClock:
  """The rows' simulated clock of :mod:`fedjx.experiments.network` (module docstring).

  Attributes:
    elapsed: ``simulated_elapsed_s`` after the last simulated round.
  """

  def __init__(self, config: Any, params: Any, elapsed: float = 0.0):
    section = config.network
    knobs = schedule_knobs(config)
    self.rounds_per_schedule = knobs.pop('rounds_per_schedule')
    self.round_steps = knobs['inner_steps'] // self.rounds_per_schedule
    flags = argparse.Namespace(bandwidth_gbps=float(section['bandwidth_gbps']),
                               latency_ms=float(section['latency_ms']),
                               topology=section['topology'], **knobs)
    try:
      self.schedule, self.network = network.from_flags(flags)
    except ValueError as e:
      raise ConfigError(f'config.network with config.algorithm '
                        f'{config.algorithm.name!r}: {e}') from None
    self.step_seconds = section['step_seconds']
    leaves = jax.tree.leaves(params)
    self.parameters = sum(int(np.size(x)) for x in leaves)
    self.model_bytes = float(sum(int(np.size(x)) * np.dtype(x.dtype).itemsize
                                 for x in leaves))
    self.wire_bytes = section['wire_bytes']
    self.default_replicas = int(config.cohort_size)
    self.elapsed = float(elapsed)

  def payload_bytes(self, row: Mapping[str, float]) -> tuple[float, int]:
    """``(bytes the model all-reduces, replicas)`` of a round's ``row``."""
    replicas = int(round(row.get('clients', self.default_replicas)))
    if self.wire_bytes is not None:
      return self.parameters * float(self.wire_bytes), max(1, replicas)
    if 'communicated_bytes' not in row:
      if 'upload_bits' in row:  # A compressing aggregator's mean message.
        return float(row['upload_bits']) / 8.0, max(1, replicas)
      return self.model_bytes, max(1, replicas)
    if replicas < 1:
      return 0.0, 1
    return float(row['communicated_bytes']) / replicas * self.rounds_per_schedule, replicas

  def timing(self, row: Mapping[str, float], step_seconds: float) -> network.Timing:
    """:func:`network.simulate` of the round of ``row``, a step taking ``step_seconds``."""
    payload, replicas = self.payload_bytes(row)
    return network.simulate(self.schedule, network.Compute.from_step_seconds(step_seconds),
                            self.network, payload, replicas)

  def advance(self, row: Mapping[str, float], wall_seconds: float | None) -> dict[str, float]:
    """What the round of ``row`` adds (``wall_seconds``: its measured time, None
    in the round that compiled)."""
    step = self.step_seconds
    if step is None:
      if wall_seconds is None or not wall_seconds > 0:
        return {}
      step = wall_seconds / self.round_steps
    timing = self.timing(row, step)
    round_s = timing.round_seconds / self.rounds_per_schedule
    self.elapsed += round_s
    return {'simulated_round_s': round_s, 'simulated_step_s': timing.step_seconds,
            'compute_utilization': timing.utilization,
            'simulated_elapsed_s': self.elapsed}

  def meta(self) -> dict[str, float]:
    """What a checkpoint records so that a resumed run's clock continues."""
    return {'simulated_elapsed_s': self.elapsed}


def make(config: Any, params: Any, meta: Mapping[str, Any] | None) -> NetworkClock | None:
  """The clock of ``config.network``, or None when it is off."""
  section = config.get('network')
  if not section or section['bandwidth_gbps'] is None:
    return None
  return NetworkClock(config, params, float((meta or {}).get('simulated_elapsed_s', 0.0)))
