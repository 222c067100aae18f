"""``fedjx-plan --config FILE[:ARG]``: plans exactly the run ``fedjx-run`` would run.

The command line is ``fedjx-run``'s (:mod:`fedjx.experiments.cli`: the same
config loading, ``--config.PATH=VALUE`` overrides, one-line errors and exit
status 2), and the experiment is built the runner's way
(:func:`fedjx.experiments.round_plan.plan_config`). Nothing is trained or
written. ``--device NAME`` holds the plan against a named accelerator
(default: the one JAX sees, else the host CPU, said to be assumed);
``--tpu TOPOLOGY`` plans the config's language-model round on a TPU
topology with the TPU compiler instead
(:func:`fedjx.experiments.round_plan.plan_config_pod`); ``--json`` prints
the plan as one JSON line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from absl import flags

from fedjx.experiments import cli

PROG = 'fedjx-plan'

_DEVICE = flags.DEFINE_string(
    'device', None, 'Accelerator to hold the plan against (a key of '
    'fedjx.experiments.lm_cost.DEVICE_MEMORY); default the one JAX sees, else the host CPU.')
_TPU = flags.DEFINE_string(
    'tpu', None, "TPU topology to plan the round for with libtpu's compiler, e.g. "
    'v5e:16x16, v5e-256, v5p:4x4x4.')
_NUM_SLICES = flags.DEFINE_integer(
    'num_slices', 1, 'Slices of --tpu, joined by the data-centre network.')
_JSON = flags.DEFINE_bool('json', False, 'Print the plan as one JSON line instead of a table.')

USAGE = """\
fedjx-plan: plans the run of a config before it runs: memory per device by
kind, FLOPs and bytes on the wire of a round, and whether it fits.

usage: fedjx-plan --config FILE[:ARG] [--config.PATH=VALUE ...]
                  [--device NAME | --tpu TOPOLOGY [--num_slices S]] [--json]
       fedjx-plan --preset NAME [--replicas M --fsdp F --tensor T ...]
                  [--device NAME | --tpu TOPOLOGY] [--json]   (fedjx-plan --preset 1m --help)

  --config FILE[:ARG]   the config fedjx-run would run, with the same
  --config.PATH=VALUE   overrides; its experiment is built and its first
                        round compiled from shapes (nothing is trained)
  --device NAME         hold the plan against this accelerator (h100, h200,
                        a100-40gb, a100-80gb, tpu-v4, tpu-v5e, tpu-v5p,
                        tpu-v6e); default the one JAX sees, else the host CPU
  --tpu TOPOLOGY        plan the round (a llama_lm DiLoCo or FedAvg config)
                        on a TPU topology with libtpu's compiler: v5e:16x16,
                        v5e-256, v5p:4x4x4, v5p-128 (needs the tpu extra:
                        pip install -e '.[tpu]')
  --num_slices S        S slices of the topology over the data-centre network
  --json                one JSON line instead of the table

examples:
  fedjx-plan --config configs/fedavg_digits.py
  fedjx-plan --config configs/diloco_study.py:4,35m --config.dataset.seq_len=2048 \\
      --config.model.dtype=bfloat16 --device tpu-v5e
  fedjx-plan --config configs/diloco_study.py:4,35m --config.dataset.seq_len=2048 \\
      --config.model.dtype=bfloat16 --tpu v5e:16x16
"""


def _spec(argv: Sequence[str]) -> str:
  return cli._config_spec(argv) or ''  # pylint: disable=protected-access


def _plan(argv: Sequence[str], extras: Sequence[Any]) -> int:
  if len(argv) > 1:
    raise cli.UsageError(f'unexpected arguments {argv[1:]}; settings go in '
                         '--config.<field>=<value> (see --help).')
  for name in ('workdir', 'fresh', 'yes'):
    if flags.FLAGS[name].present:
      raise cli.UsageError(f'--{name}: {PROG} trains nothing and writes nothing; leave '
                           'it out.')
  if _TPU.value and _DEVICE.value:
    raise cli.UsageError(f'--device={_DEVICE.value} and --tpu={_TPU.value}: give '
                         'one (a topology names its chips).')
  if _NUM_SLICES.value != 1 and not _TPU.value:
    raise cli.UsageError(f'--num_slices={_NUM_SLICES.value} needs --tpu.')
  config = cli.loaded_config(extras)
  spec = _spec(sys.argv)
  from fedjx.experiments import plan_report  # deferred: before JAX (usage errors, config checks)
  from fedjx.experiments import round_plan  # deferred: before JAX (usage errors, config checks)
  if _TPU.value:
    from fedjx.experiments import topology_plan  # deferred: before JAX (usage errors, config checks)
    top = topology_plan.topology(_TPU.value, _NUM_SLICES.value)
    plan = round_plan.plan_config_pod(config, top)
    on_host = None
    if not plan.fits and plan.algorithm == 'diloco' and plan.replica_states == 'device':
      on_host = round_plan.plan_config_pod(config, top, replica_states='store')
    row = dict(plan.to_json(), config=spec)
    if on_host is not None:
      row.update(store_fits=on_host.fits, store_peak_bytes=on_host.peak_bytes,
                 store_round_s=on_host.round_s)
    text = plan_report.render_pod(plan, PROG, spec, on_host)
  else:
    device = plan_report.target(_DEVICE.value)
    plan = round_plan.plan_config(config, lambda msg: print(f'{PROG}: {msg}', file=sys.stderr))
    row = dict(plan.to_json(), config=spec, device=device.name,
               device_memory_bytes=device.memory_bytes, device_source=device.source,
               fits=device.fits(plan.peak_bytes),
               streams=plan.streams(device.memory_bytes))
    text = plan_report.render_round(plan, device, spec, PROG)
  sys.stdout.write(json.dumps(row) + '\n' if _JSON.value else text)
  return 0


def main(argv: Sequence[str] | None = None) -> None:
  """Console entry of the config mode (``sys.argv``, or ``argv`` without the program)."""
  if argv is not None:
    sys.argv = [PROG, *argv]
  cli.main(PROG, _plan, USAGE)
