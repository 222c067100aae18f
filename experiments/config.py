"""The schema of an experiment config: its fields, defaults and checks.

Config files (``configs/*.py``) import this module (through
:mod:`fedjx.experiments.config_base`), so it is kept light: it imports
neither the training loop nor Orbax, matplotlib, flax or any algorithm.
:func:`validate` looks names up in :mod:`fedjx.experiments.registry` and
imports it only when called.

* :data:`DEFAULTS`: every top-level field and its default; ``dataset``,
  ``model`` and ``algorithm`` (:data:`REQUIRED`) are dicts with a ``name``.
* :func:`with_defaults`: a copy with the defaults filled in and the values
  checked (one-line :class:`ConfigError` naming the field and what is allowed).
* :func:`validate`: also checks names and options against the registries.
* :func:`fingerprint` / :func:`config_hash`: what identifies an experiment's
  results (:data:`RESUMABLE_CHANGES` left out), used to refuse resuming a
  workdir with a different experiment.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

import ml_collections

from fedjx import options
from fedjx.experiments.errors import ConfigError
from fedjx.experiments.errors import suggest
from fedjx.experiments import lora_setup

METRICS_FORMATS = ('jsonl', 'csv')


# Top-level config fields and their defaults. ``dataset``, ``model`` and
# ``algorithm`` are required.
DEFAULTS: dict[str, Any] = {
    'seed': 0,
    'rounds': 100,
    'cohort_size': 10,
    'batch_size': 20,
    'local_epochs': None,       # passes over each client's data per round
    'local_steps': None,        # or exactly this many batches per round
    'max_local_steps': None,    # upper bound on batches per client
    'bucket_steps': True,       # pad steps to a power of two (fewer compiles)
    'eval_every': 10,
    'eval_batch_size': 256,
    'eval_max_examples': 100_000,
    'checkpoint_every': 50,
    'checkpoints_to_keep': 2,   # at least 2 are kept (damage fallback)
    'nonfinite': 'skip',        # 'skip' / 'stop' / 'off', see NONFINITE
    'map_strategy': 'auto',
    'chunk_size': None,
    'execution': 'auto',        # 'jit' | 'streaming' | 'auto', see EXECUTIONS
    'streaming_chunk_size': None,  # clients per streamed chunk (None: sized by data)
    'metrics_format': 'jsonl',
    'tensorboard': True,
    'plot': True,
    'progress': True,
    'prefetch': 1,
    'data_placement': 'auto',   # 'auto' | 'device' | 'host', see DATA_PLACEMENTS
    # Compiled rounds kept on disk for the next run: 'user' (a cache folder
    # of this user), 'workdir', 'off' or a folder (compilation_cache.py).
    'compilation_cache': 'user',
    # Device mesh axes (MESH_AXES): e.g. 'clients=-1' shards cohorts over the
    # devices; 'clients=2,fsdp=2,tensor=2' also shards each replica's model
    # FSDP-style on fsdp and (llama_lm only) Megatron-style on tensor; 'auto'
    # splits cohorts over the CPU devices of cpu_devices on a CPU backend
    # (fedjx.experiments.processes.auto_mesh), else no mesh; '' no mesh.
    'mesh': 'auto',
    # CPU devices a run that starts JAX itself makes: 'auto' (one per core)
    # or a count (processes.split_cpu).
    'cpu_devices': 'auto',
    'coordinator_address': '',  # multi-process runs: 'host:port' of process 0
    'num_processes': None,
    'process_id': None,
    # Seconds a process other than 0 waits for the coordinator to come up; a
    # program holding its port that is not the coordinator fails at once.
    'coordinator_timeout_s': 300.0,
    # Who takes part in each round, and how a DP run is accounted: see
    # SAMPLING_OPTIONS, PRIVACY_DEFAULTS and docs/privacy.md.
    'sampling': {'name': 'uniform'},
    'privacy': {'delta': None, 'accountant': 'rdp', 'target_epsilon': None,
                'audit': None},  # PRIVACY_DEFAULTS
    # Unreliable clients on a simulated clock (fedjx.datasets.systems): {}
    # (perfect clients) or a dict of availability/dropout/speed/deadline.
    'systems': {},
    # Malicious clients (fedjx.experiments.attack, docs/robustness.md):
    # {name, fraction, seed, **options}, the named attack's options besides;
    # see ATTACK_DEFAULTS.
    'attack': {'name': '', 'fraction': 0.0, 'seed': None},
    # Where per-client state kept between rounds (SCAFFOLD's control
    # variates, a personal model, DiLoCo's inner optimizer states) lives:
    # see CLIENT_STATE_DEFAULTS and docs/client_state.md.
    'client_state': {'placement': 'auto', 'memory_budget_mb': 1024,
                     'directory': ''},
    # A simulated wall clock from a communication model
    # (fedjx.experiments.network_clock, docs/experiments.md): off while
    # bandwidth_gbps is None; see NETWORK_DEFAULTS.
    'network': {'bandwidth_gbps': None, 'latency_ms': 0.0, 'topology': 'ring',
                'step_seconds': None, 'wire_bytes': None,
                'overlap_fraction': 0.0, 'layers': None, 'inner_steps': None},
    # Replicas that join, leave or fail mid-round (fedjx.experiments.churn,
    # docs/communication.md): off while join, leave and fail are all 0; see
    # CHURN_DEFAULTS.
    'churn': {'join': 0.0, 'leave': 0.0, 'fail': 0.0, 'seed': None,
              'tokens_per_example': 1.0},
    # LoRA adapters on a frozen (pretrained) model: off while rank is 0
    # (fedjx.experiments.lora_setup, docs/fine_tuning.md).
    'lora': dict(lora_setup.LORA_DEFAULTS),
}
REQUIRED = ('dataset', 'model', 'algorithm')
# The type of each field whose default is None, by dotted path: what a
# command-line value of it is parsed as (base_config() declares them as typed
# ml_collections placeholders, which still read as None).
OPTIONAL_TYPES: dict[str, type] = {
    'local_epochs': int, 'local_steps': int, 'max_local_steps': int,
    'chunk_size': int, 'streaming_chunk_size': int, 'num_processes': int,
    'process_id': int,
    'privacy.delta': float, 'privacy.target_epsilon': float,
    'sampling.rate': float, 'sampling.max_cohort_size': int,
    'attack.seed': int,
    'network.bandwidth_gbps': float, 'network.step_seconds': float,
    'network.wire_bytes': float, 'network.layers': int,
    'network.inner_steps': int,
    'churn.seed': int,
}
# config.sampling: 'uniform' (cohort_size clients without replacement, the
# default), 'poisson' (each client with probability rate, default
# cohort_size / N; cohorts padded to a bucket of max_cohort_size, default
# q N + 6 standard deviations) or 'epochs' (shuffled epochs: each client at
# most once per epoch of N // cohort_size rounds). The options each allows:
SAMPLING_OPTIONS = {'uniform': (), 'poisson': ('rate', 'max_cohort_size'),
                    'epochs': ()}
# config.privacy: delta (None: N^-1.1), accountant ('rdp' or 'pld'), a
# budget target_epsilon at which the run stops (None: no budget) and an
# empirical audit from canary clients (None, or a dict of AUDIT_DEFAULTS;
# fedjx.algorithms.privacy.audit, docs/privacy.md).
PRIVACY_DEFAULTS = dict(DEFAULTS['privacy'])
# config.privacy.audit: canaries (how many canary clients, required), seed
# (of their directions and signs; None: config.seed), confidence (of the
# estimate's interval and of the one-run bound) and resamples (bootstrap
# resamples of the interval).
AUDIT_DEFAULTS = {'canaries': None, 'seed': None, 'confidence': 0.95,
                  'resamples': 1000}
# config.attack, a spec like every other part: name ('' for no attack; one
# of fedjx.experiments.parts.ATTACKS), fraction (of the training population
# that is malicious, in [0, 1): floor(fraction N + 1/2) clients, halves
# rounded up (fedjx.algorithms.attacks.malicious_count), drawn from seed,
# None: config.seed) and any other key an option of the named attack, a
# keyword of its builder (dict(name='alie', fraction=0.2, z=1.5)); an option
# not given takes the builder's default. Model poisoning replaces the
# malicious clients' messages (fedjx.algorithms.attacks); data poisoning
# changes their examples (fedjx.datasets.poisoning) and adds
# eval_attack_success_rate. with_defaults checks the section's own keys;
# validate the name and the options (fedjx.experiments.parts.build_attack).
ATTACK_DEFAULTS = dict(DEFAULTS['attack'])
# config.client_state, for an algorithm whose clients keep state between
# rounds: placement 'store' (a fedjx.client_store.ClientStore on the host:
# each round reads its cohort's rows and writes them back, memory_budget_mb
# of them in memory and the rest memory-mapped under directory, '' for
# <workdir>/client_states), 'device' (a dense [N, ...] array in the
# server state, for algorithms that offer one: SCAFFOLD, DiLoCo) or 'auto'
# (fedjx.experiments.registry.resolve_placement: 'device' for a population of
# replicas, DiLoCo's, 'store' for a population of clients).
CLIENT_STATE_DEFAULTS = dict(DEFAULTS['client_state'])
CLIENT_STATE_PLACEMENTS = ('auto', 'store', 'device')
# config.network: each round's simulated wall clock over a link of
# bandwidth_gbps Gbit/s (None: off, nothing added to the metrics) and
# latency_ms per message, all-reduced over topology (NETWORK_TOPOLOGIES);
# step_seconds is the compute time of one inner step (None: measured, the
# round's wall seconds over its inner steps), wire_bytes the bytes sent per
# parameter (None: the round's own communicated_bytes), overlap_fraction and
# layers the DiLoCo overlap of fedjx.experiments.network.Schedule, and
# inner_steps H (None: config.local_steps). It adds metrics and changes no
# result, so a resumed run may change it (RESUMABLE_CHANGES).
NETWORK_DEFAULTS = dict(DEFAULTS['network'])
NETWORK_TOPOLOGIES = ('ring', 'tree', 'parameter_server')
# config.nonfinite: what a NaN/Inf does. 'skip': clients with a non-finite
# update or weight are left out of the aggregate (builders get
# skip_nonfinite=True) and the run stops only if the server parameters become
# non-finite or every client of a round was non-finite (nothing to
# aggregate); 'stop': also stop at the first round with such a client; 'off':
# nothing is checked (builders get skip_nonfinite=False).
NONFINITE = ('skip', 'stop', 'off')
# config.churn: a seeded schedule of DiLoCo replicas
# (fedjx.experiments.churn.seeded_schedule) that join (join: probability that
# a replica that did not contribute to the previous round is present),
# leave (leave: that one that did is absent) or fail mid-round (fail: that a
# present one fails), drawn from seed (None: config.seed); off (the rounds of
# a run without the section) while join, leave and fail are all 0.
# tokens_per_example counts the tokens of one example (the sequence length
# for a language model; 1 counts examples) for the rows' useful_tokens,
# wasted_tokens and goodput.
CHURN_DEFAULTS = dict(DEFAULTS['churn'])
# config.execution: how a round runs (fedjx.execution): 'jit' compiles the
# whole round; 'streaming' runs it from its plan with clients arriving from
# the host in chunks; 'auto' streams when XLA's memory plan of the compiled
# round would not fit the device. config.map_strategy, config.chunk_size
# (clients per chunk of map_fn), config.execution and
# config.streaming_chunk_size (clients per streamed chunk) are checked once,
# by fedjx.options.RoundOptions.of in with_defaults; the runner carries
# RoundOptions.of(config).map to Algorithm.compile as it is.
EXECUTIONS = options.EXECUTIONS
# config.data_placement: where the training population's examples live.
# 'device' holds them once on the device (fedjx.datasets.on_device), so a
# round's cohort is an index of table rows (5 bytes per padded example slot
# moved per round, no padded copy built on the host); 'host' builds each
# round's padded [C, S, B, ...] arrays on the host and copies them over (and
# is what streamed rounds, multi-process runs, config.systems and
# asynchronous schedules read); 'auto' is 'device' when the run is on one
# process, not streamed (config.execution 'jit' or 'auto'), without
# config.systems or an asynchronous schedule, and the population fits
# fedjx.datasets.device_data.AUTO_MAX_BYTES for the backend; else 'host'. The
# two give the same rounds.
DATA_PLACEMENTS = ('auto', 'device', 'host')
# Fields a resumed run may change without changing its results.
RESUMABLE_CHANGES = ('rounds', 'eval_every', 'checkpoint_every', 'progress',
                     'plot', 'tensorboard', 'prefetch', 'checkpoints_to_keep',
                     'data_placement', 'compilation_cache',
                     'mesh', 'cpu_devices', 'coordinator_address',
                     'num_processes', 'process_id', 'coordinator_timeout_s',
                     'execution',
                     'streaming_chunk_size', 'network')
# Fields inside sections that a resumed run may change (where rows live, not
# what they hold).
RESUMABLE_FIELDS = ('client_state.memory_budget_mb', 'client_state.directory')


def with_defaults(config: Any) -> ml_collections.ConfigDict:
  """A copy of ``config`` with every default filled in, checked for unknown fields."""
  config = ml_collections.ConfigDict(
      config.to_dict() if hasattr(config, 'to_dict') else dict(config))
  valid = sorted(set(DEFAULTS) | set(REQUIRED))
  for key in config.keys():
    if key not in valid:
      raise ConfigError(
          f'unknown config field {key!r}.{suggest(key, valid)} '
          f'Valid top-level fields: {valid}.')
  for key in REQUIRED:
    if key not in config:
      raise ConfigError(f'config.{key} is required (a dict with a "name" '
                                 f'key); valid names: {_names(key)}.')
  with config.unlocked():
    for key, value in DEFAULTS.items():
      if key not in config:
        setattr(config, key, value)
  for key in ('rounds', 'cohort_size', 'batch_size', 'eval_every',
              'checkpoint_every', 'eval_batch_size'):
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < (
        0 if key == 'rounds' else 1):
      raise ConfigError(f'config.{key}={value!r}; it must be a '
                                 f'{"non-negative" if key == "rounds" else "positive"} int.')
  keep = config.checkpoints_to_keep
  if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
    raise ConfigError(f'config.checkpoints_to_keep={keep!r}; it must be '
                               'a positive int (at least 2 are kept).')
  if config.nonfinite not in NONFINITE:
    raise ConfigError(f'config.nonfinite={config.nonfinite!r} is not '
                               f'one of {NONFINITE}.')
  try:
    options.RoundOptions.of(config)
  except ValueError as e:
    hint = (suggest(config.map_strategy, options.MAP_STRATEGIES)
            if config.map_strategy not in options.MAP_STRATEGIES else '')
    raise ConfigError(f'{e}{hint}') from None
  wait = config.coordinator_timeout_s
  if not (_number(wait) and math.isfinite(wait) and wait > 0):
    raise ConfigError(f'config.coordinator_timeout_s={wait!r}; it must be a '
                      'positive number of seconds.')
  check_mesh(config)
  cpu = config.cpu_devices
  if isinstance(cpu, str) and cpu.isdigit():  # From the command line.
    cpu = int(cpu)
  if cpu != 'auto' and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 1):
    raise ConfigError(f'config.cpu_devices={cpu!r}; it must be a positive int '
                      "or 'auto' (one CPU device per core).")
  if not isinstance(config.compilation_cache, str) or not config.compilation_cache:
    raise ConfigError(f'config.compilation_cache={config.compilation_cache!r};'
                      " it must be 'user', 'workdir', 'off' or a folder's path.")
  if config.data_placement not in DATA_PLACEMENTS:
    raise ConfigError(f'config.data_placement={config.data_placement!r} is '
                      f'not one of {DATA_PLACEMENTS}.'
                      f'{suggest(config.data_placement, DATA_PLACEMENTS)}')
  if config.metrics_format not in METRICS_FORMATS:
    raise ConfigError(f'config.metrics_format={config.metrics_format!r} '
                               f'is not one of {METRICS_FORMATS}.')
  _check_sampling_and_privacy(config)
  _check_attack(config)
  _check_client_state(config)
  _check_network(config)
  _check_churn(config)
  lora_setup.lora_config_of(config)
  return config


MESH_AXES = ('clients', 'fsdp', 'tensor')
"""The axes ``config.mesh`` may name. ``clients``: the cohort's clients (DiLoCo's
replicas) are split over it; ``fsdp``: every replica's parameters and optimizer
state are split over it FSDP-style (ZeRO stage 3, Rajbhandari et al. 2020,
arXiv 1910.02054) and its batch with them; ``tensor``: a ``llama_lm``
replica's matrices are split over it Megatron-style (Shoeybi et al. 2019,
arXiv 1909.08053). :func:`fedjx.sharding.replica_specs` gives the layout."""


def mesh_axes(mesh: str) -> dict[str, int]:
  """Axis names to sizes of a ``config.mesh`` string, in order.

  ``'clients=-1'``, ``'clients=4,fsdp=2'``, ``'clients=2,fsdp=2,tensor=2'``:
  comma-separated ``name=size`` items, names Python identifiers, each once,
  sizes integers (-1: the devices left over, checked when the mesh is laid
  out). Raises :class:`ConfigError` in one line. (Which names a run accepts
  is :func:`check_mesh`'s.)
  """
  axes: dict[str, int] = {}
  for item in str(mesh).split(','):
    name, _, size = (part.strip() for part in item.partition('='))
    try:
      value = int(size)
    except ValueError:
      value = None
    if value is None or not name.isidentifier():
      raise ConfigError(
          f'config.mesh={mesh!r}: write axis sizes as '
          "'clients=-1', 'clients=4,fsdp=2' or 'clients=2,fsdp=2,tensor=2'.")
    if name in axes:
      raise ConfigError(f'config.mesh={mesh!r}: the axis {name!r} is named twice; '
                        'name each axis once.')
    axes[name] = value
  return axes


def check_mesh(config: ml_collections.ConfigDict) -> dict[str, int]:
  """Checks ``config.mesh`` against the run (no JAX): its axes by name.

  Refuses, in one line naming the value and what is allowed: a non-string;
  an axis not in :data:`MESH_AXES`; a size that is neither a positive int nor
  -1; a ``tensor`` axis of more than one device for a model other than
  ``llama_lm`` (only the Llama layout splits matrices Megatron-style) or for
  a LoRA run (``config.lora.rank > 0``, whose server state is the adapters).
  """
  mesh = config.mesh
  if not isinstance(mesh, str):
    raise ConfigError(f'config.mesh={mesh!r}; it must be a str such as '
                      "'clients=-1' or 'clients=2,fsdp=2,tensor=2' ('' for no "
                      "mesh, 'auto' for the cohort over the CPU's cores).")
  if not mesh or mesh == 'auto':
    return {}
  axes = mesh_axes(mesh)
  for name, size in axes.items():
    if name not in MESH_AXES:
      raise ConfigError(
          f'config.mesh={mesh!r}: the axis {name!r} is not one of {MESH_AXES} '
          "(clients: the cohort; fsdp and tensor: each replica's model)."
          f'{suggest(name, MESH_AXES)}')
    if size != -1 and size < 1:
      raise ConfigError(f'config.mesh={mesh!r}: the axis {name!r} has size {size}; '
                        'sizes are positive ints or -1 (the devices left over).')
  if axes.get('tensor', 1) != 1:
    model = _as_dict(config.model)
    name = model.get('name') if isinstance(model, Mapping) else None
    if name != 'llama_lm':
      raise ConfigError(
          f'config.mesh={mesh!r}: the tensor axis splits a llama_lm model '
          f"Megatron-style, and config.model.name={name!r} has no such layout; "
          "use 'llama_lm', or shard the model on fsdp only.")
    rank = _as_dict(config.lora).get('rank', 0) if isinstance(
        _as_dict(config.lora), Mapping) else 0
    if rank:
      raise ConfigError(
          f'config.mesh={mesh!r}: the tensor axis splits the full model, and '
          f'config.lora.rank={rank!r} trains adapters; with LoRA use clients '
          'and fsdp axes only.')
  return axes


def _section(path: str, value: Any, defaults: Mapping[str, Any], *,
             none_ok: bool = False) -> dict[str, Any] | None:
  """``config.<path>``, a dict of options, with ``defaults`` filled in.

  Refuses what is not a dict (None too, unless ``none_ok``: then None is
  returned) and any key ``defaults`` does not have, naming the valid keys.
  """
  value = _as_dict(value)
  if value is None and none_ok:
    return None
  if not isinstance(value, Mapping):
    allowed = 'None or a dict' if none_ok else 'a dict'
    raise ConfigError(f'config.{path}={value!r}; it must be {allowed} with '
                      f'keys {sorted(defaults)}.')
  for key in value:
    if key not in defaults:
      raise ConfigError(f'config.{path}[{key!r}] is unknown.'
                        f'{suggest(key, defaults)} Valid keys: '
                        f'{sorted(defaults)}.')
  return dict(defaults, **value)


def _check_attack(config: ml_collections.ConfigDict) -> None:
  """Checks ``config.attack``'s own keys (name, fraction, seed) and fills
  their defaults; the named attack's options are checked by :func:`validate`
  (:func:`fedjx.experiments.parts.build_attack`, which imports the attacks)."""
  attack = _as_dict(config.attack)
  if not isinstance(attack, Mapping):
    raise ConfigError(f'config.attack={attack!r}; it must be a dict with a '
                      "'name' (e.g. dict(name='sign_flip', fraction=0.2)).")
  attack = dict(ATTACK_DEFAULTS, **attack)
  name, fraction = attack['name'], attack['fraction']
  if not isinstance(name, str):
    raise ConfigError(f'config.attack.name={name!r}; it must be the name of an '
                      "attack (a str, '' for no attack).")
  if not (_number(fraction) and 0 <= fraction < 1):
    raise ConfigError(f'config.attack.fraction={fraction!r}; it must be a number '
                      'in [0, 1), the malicious share of the population.')
  if attack['seed'] is not None and not (_int(attack['seed']) and attack['seed'] >= 0):
    raise ConfigError(f"config.attack.seed={attack['seed']!r}; it must be an "
                      'int >= 0 or None (config.seed).')
  if not name:
    for key, value in attack.items():
      if key not in ATTACK_DEFAULTS:
        raise ConfigError(f'config.attack.{key}={value!r} but no '
                          'config.attack.name; name the attack it is an option '
                          "of, e.g. config.attack.name='sign_flip'.")
    if fraction:
      raise ConfigError(f'config.attack.fraction={fraction!r} but no '
                        'config.attack.name; name an attack, e.g. '
                        "config.attack.name='sign_flip'.")
  with config.unlocked():
    config.attack = attack


def _check_client_state(config: ml_collections.ConfigDict) -> None:
  """Checks ``config.client_state`` and fills its defaults."""
  section = _section('client_state', config.client_state, CLIENT_STATE_DEFAULTS)
  placement = section['placement']
  if placement not in CLIENT_STATE_PLACEMENTS:
    raise ConfigError(f'config.client_state.placement={placement!r} is not one '
                      f'of {CLIENT_STATE_PLACEMENTS}.{suggest(placement, CLIENT_STATE_PLACEMENTS)}')
  budget = section['memory_budget_mb']
  if not _number(budget) or not math.isfinite(budget) or budget < 0:
    raise ConfigError(f'config.client_state.memory_budget_mb={budget!r}; it must '
                      'be a non-negative number of MiB (rows beyond it are '
                      'memory-mapped on disk).')
  directory = section['directory']
  if not isinstance(directory, str):
    raise ConfigError(f'config.client_state.directory={directory!r}; it must be '
                      "a path, or '' for <workdir>/client_states.")
  with config.unlocked():
    config.client_state = section


def _check_network(config: ml_collections.ConfigDict) -> None:
  """Checks ``config.network`` and fills its defaults."""
  section = _section('network', config.network, NETWORK_DEFAULTS, none_ok=True)
  if section is None:  # None: off, as bandwidth_gbps=None.
    section = dict(NETWORK_DEFAULTS)
  def bad(key: str, allowed: str) -> ConfigError:
    return ConfigError(f'config.network.{key}={section[key]!r}; allowed: {allowed}.')
  bandwidth = section['bandwidth_gbps']
  if bandwidth is not None and not (_number(bandwidth) and bandwidth > 0):
    raise bad('bandwidth_gbps', 'a number > 0 of Gbit/s (math.inf allowed), or '
              'None (no simulated clock)')
  latency = section['latency_ms']
  if not (_number(latency) and 0 <= latency < math.inf):
    raise bad('latency_ms', 'a finite number >= 0 of milliseconds per message')
  if section['topology'] not in NETWORK_TOPOLOGIES:
    raise ConfigError(f"config.network.topology={section['topology']!r}; allowed: "
                      f"one of {NETWORK_TOPOLOGIES}."
                      f"{suggest(section['topology'], NETWORK_TOPOLOGIES)}")
  for key, what in (('step_seconds', 'seconds of compute per inner step, or None '
                     '(measured: the round\'s wall seconds over its inner steps)'),
                    ('wire_bytes', 'bytes sent per parameter, or None (the '
                     'round\'s own communicated_bytes)')):
    value = section[key]
    if value is not None and not (_number(value) and 0 < value < math.inf):
      raise bad(key, f'a finite number > 0 of {what}')
  fraction = section['overlap_fraction']
  if not (_number(fraction) and 0 <= fraction <= 1):
    raise bad('overlap_fraction', 'a number in [0, 1], the share of the round\'s '
              'last inner step the reduction overlaps (0: blocking)')
  for key in ('layers', 'inner_steps'):
    value = section[key]
    if value is not None and not (_int(value) and value >= 1):
      raise bad(key, 'an int >= 1, or None' + (
          ' (config.local_steps)' if key == 'inner_steps' else
          ' (infinitely many)'))
  if bandwidth is not None and section['inner_steps'] is None and (
      config.get('local_steps') is None):
    raise ConfigError('config.network.inner_steps=None and config.local_steps=None; '
                      'allowed: an int >= 1 in either (H, the inner steps of a '
                      'round the simulated clock charges).')
  with config.unlocked():
    config.network = section


def _check_churn(config: ml_collections.ConfigDict) -> None:
  """Checks ``config.churn`` and fills its defaults (None: off)."""
  section = _section('churn', config.churn, CHURN_DEFAULTS, none_ok=True)
  if section is None:
    section = dict(CHURN_DEFAULTS)
  for key in ('join', 'leave', 'fail'):
    value = section[key]
    if not (_number(value) and 0 <= value <= 1):
      raise ConfigError(f'config.churn.{key}={value!r}; allowed: a probability '
                        'in [0, 1].')
  seed = section['seed']
  if seed is not None and not (_int(seed) and seed >= 0):
    raise ConfigError(f'config.churn.seed={seed!r}; allowed: an int >= 0, or None '
                      '(config.seed).')
  tokens = section['tokens_per_example']
  if not (_number(tokens) and 0 < tokens < math.inf):
    raise ConfigError(f'config.churn.tokens_per_example={tokens!r}; allowed: a '
                      'finite number > 0 (the sequence length of a language '
                      'model, 1 to count examples).')
  with config.unlocked():
    config.churn = section


def churn_on(config: ml_collections.ConfigDict) -> bool:
  """Whether ``config.churn`` (defaults filled) draws any churn."""
  section = config.get('churn')
  return bool(section) and any(section[k] > 0 for k in ('join', 'leave', 'fail'))


def _number(value: Any) -> bool:
  return not isinstance(value, bool) and isinstance(value, (int, float))


def _as_dict(value: Any) -> Any:
  return value.to_dict() if hasattr(value, 'to_dict') else value


def _check_sampling_and_privacy(config: ml_collections.ConfigDict) -> None:
  """Checks ``config.sampling`` and ``config.privacy``; fills privacy defaults."""
  sampling = _as_dict(config.sampling)
  if not isinstance(sampling, Mapping) or sampling.get('name') not in SAMPLING_OPTIONS:
    name = sampling.get('name') if isinstance(sampling, Mapping) else sampling
    raise ConfigError(f'config.sampling name={name!r} is not one of '
                      f'{tuple(SAMPLING_OPTIONS)}.')
  allowed = SAMPLING_OPTIONS[sampling['name']]
  for key in sampling.keys():
    if key != 'name' and key not in allowed:
      raise ConfigError(f'config.sampling[{key!r}] is not an option of '
                        f"{sampling['name']!r} sampling; it takes {allowed}.")
  rate = sampling.get('rate')
  if rate is not None and not (_number(rate) and 0 < rate <= 1):
    raise ConfigError(f"config.sampling['rate']={rate!r}; it must be a number "
                      'in (0, 1] or None (cohort_size / number of clients).')
  bucket = sampling.get('max_cohort_size')
  if bucket is not None and (isinstance(bucket, bool) or
                             not isinstance(bucket, int) or bucket < 1):
    raise ConfigError(f"config.sampling['max_cohort_size']={bucket!r}; it must "
                      'be an int >= 1 or None (q N + 6 standard deviations).')
  privacy = _section('privacy', config.privacy, PRIVACY_DEFAULTS)
  with config.unlocked():
    config.privacy = privacy
  delta, target = config.privacy.delta, config.privacy.target_epsilon
  if delta is not None and not (_number(delta) and 0 < delta < 1):
    raise ConfigError(f'config.privacy.delta={delta!r}; it must be a number in '
                      '(0, 1) or None (N^-1.1 for N clients).')
  if config.privacy.accountant not in ('rdp', 'pld'):
    raise ConfigError(f'config.privacy.accountant={config.privacy.accountant!r}'
                      " is not one of ('rdp', 'pld').")
  if target is not None and not (_number(target) and target > 0):
    raise ConfigError(f'config.privacy.target_epsilon={target!r}; it must be a '
                      'number > 0 or None (no budget).')
  _check_audit(config)


def _int(value: Any) -> bool:
  return not isinstance(value, bool) and isinstance(value, int)


def _check_audit(config: ml_collections.ConfigDict) -> None:
  """Checks ``config.privacy.audit`` and fills its defaults."""
  audit = _section('privacy.audit', config.privacy.audit, AUDIT_DEFAULTS,
                   none_ok=True)
  if audit is None:
    return
  if not (_int(audit['canaries']) and audit['canaries'] >= 2):
    raise ConfigError(f"config.privacy.audit['canaries']={audit['canaries']!r}; "
                      'it must be an int >= 2 (the number of canary clients, '
                      'e.g. 1000).')
  if audit['seed'] is not None and not _int(audit['seed']):
    raise ConfigError(f"config.privacy.audit['seed']={audit['seed']!r}; it "
                      'must be an int or None (config.seed).')
  if not (_number(audit['confidence']) and 0 < audit['confidence'] < 1):
    raise ConfigError(f"config.privacy.audit['confidence']="
                      f"{audit['confidence']!r}; it must be a number in (0, 1).")
  if not (_int(audit['resamples']) and audit['resamples'] >= 0):
    raise ConfigError(f"config.privacy.audit['resamples']="
                      f"{audit['resamples']!r}; it must be an int >= 0 (0: no "
                      'bootstrap interval).')
  with config.unlocked():
    config.privacy.audit = audit


def validate(config: Any) -> ml_collections.ConfigDict:
  """Checks a config without loading data: fields, names and their options.

  Returns the config with defaults filled in; raises :class:`ConfigError`
  naming the first problem and listing what is valid. (This looks the names
  up in :mod:`fedjx.experiments.registry`, which imports the models and
  algorithms; :func:`with_defaults` alone imports neither.)
  """
  from fedjx.experiments import registry  # deferred: before JAX (usage errors, config checks)
  config = with_defaults(config)
  for kind, table in (('dataset', registry.DATASETS), ('model', registry.MODELS)):
    name, kwargs = registry.split_name(kind, config[kind])
    registry.check_kwargs(kind, name, registry.lookup(kind, table, name), kwargs)
    registry.check_types(kind, registry.builder_options(name, kind), kwargs)
    registry.check_numbers(kind, kwargs, non_negative=False)
  registry.check_paths('dataset', registry.split_name('dataset', config.dataset)[1])
  name, kwargs = registry.split_name('algorithm', config.algorithm)
  registry.check_algorithm_kwargs(name, kwargs)
  registry.check_types('algorithm', registry.builder_options(name), kwargs)
  registry.check_numbers('algorithm', kwargs, non_negative=True)
  registry.check_hparam_bounds(kwargs)
  check_asynchronous(config, name, kwargs)
  _check_systems(config.systems)
  if config.attack['name']:
    from fedjx.experiments import parts  # deferred: before JAX (usage errors, config checks)
    parts.build_attack(config.attack)
  for key, value in kwargs.items():
    if key.endswith('optimizer') and isinstance(value, Mapping):
      registry.check_optimizer(value, where=f'algorithm.{key}')
  return config


def check_asynchronous(config: ml_collections.ConfigDict, name: str,
                       kwargs: Mapping[str, Any]) -> None:
  """An asynchronous algorithm's concurrency against its buffer, the cohort."""
  from fedjx.experiments import registry  # deferred: before JAX (usage errors, config checks)
  if not registry.is_asynchronous(name):
    return
  m, k = kwargs.get('concurrency'), config.cohort_size
  if m is not None and not isinstance(m, bool) and isinstance(m, int) and m < k:
    raise ConfigError(
        f'config.algorithm.concurrency={m} is less than config.cohort_size={k}: '
        f'{name} takes cohort_size updates per server step (its buffer), so at '
        f'least that many clients must train at once; set concurrency >= {k} '
        'or a smaller cohort_size.')


def _check_systems(spec: Any) -> None:
  """A ConfigError for a ``config.systems`` the system model does not take."""
  from fedjx.datasets import systems  # deferred: before JAX (usage errors, config checks)
  try:
    systems.from_config(spec, num_clients=1)
  except ValueError as e:
    raise ConfigError(f'config.{e}') from None


def _names(key: str) -> list[str]:
  from fedjx.experiments import registry  # deferred: before JAX (usage errors, config checks)
  table = {'dataset': registry.DATASETS, 'model': registry.MODELS,
           'algorithm': registry.ALGORITHMS}[key]
  return sorted(table)


def fingerprint(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The fields of a (defaults-filled) config that determine its results."""
  d = json.loads(config.to_json_best_effort(sort_keys=True))
  for key in RESUMABLE_CHANGES:
    d.pop(key, None)
  for path in RESUMABLE_FIELDS:
    section, key = path.split('.')
    if isinstance(d.get(section), dict):
      d[section].pop(key, None)
  return d


def experiment_difference(saved: Mapping[str, Any],
                          current: Mapping[str, Any]) -> list[str]:
  """The dotted fields in which two :func:`fingerprint` s differ, sorted.

  A field added to the runner after ``saved`` was written compares equal
  when ``current`` leaves it at its default.
  """
  a, b = flatten(saved), flatten(current)
  defaults = {k: v for k, v in flatten(DEFAULTS).items() if k not in a}
  return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)
                and not (k in defaults and b.get(k) == defaults[k]))


def check_same_experiment(saved: Mapping[str, Any], current: Mapping[str, Any],
                          workdir: str) -> None:
  """Refuses to resume in ``workdir`` a checkpoint whose :func:`fingerprint`
  ``saved`` differs from ``current`` (one line naming the fields).

  Raises:
    ConfigError: they differ.
  """
  if not saved:
    return
  diff = experiment_difference(saved, current)
  if diff:
    a, b = flatten(saved), flatten(current)
    details = ', '.join(f'{k}: {a.get(k)!r} -> {b.get(k)!r}' for k in diff[:8])
    raise ConfigError(
        f'{workdir} holds a checkpoint of a different experiment ({details}). '
        'Use a new --workdir, or start over in it with --fresh. Fields that may '
        f'change on resumption: {list(RESUMABLE_CHANGES)}.')


def flatten(d: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  """``{'a': {'b': 1}}`` -> ``{'a.b': 1}``."""
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def config_hash(config: Any) -> str:
  """A short hash of a config's results-relevant fields (for run names)."""
  text = json.dumps(fingerprint(with_defaults(config)), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:10]


def streaming_chunk(config: ml_collections.ConfigDict) -> int | None:
  """Clients per streamed chunk: ``config.streaming_chunk_size`` (None: sized
  by the clients' bytes, :func:`fedjx.execution.streaming_chunk`).

  ``config.chunk_size`` is the chunk of ``map_fn`` only; it does not size
  streamed chunks.
  """
  return config.get('streaming_chunk_size')
