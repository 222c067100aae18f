"""A shipped DP config run with canary clients: its privacy audit.

``--config=configs/dp_audit.py:CONFIG[,CANARIES]``, e.g.
``configs/dp_audit.py:dp_fedavg_digits`` (the default) or
``configs/dp_audit.py:dp_diloco_digits,500``: the config
``configs/CONFIG.py`` unchanged but for
``config.privacy.audit = dict(canaries=CANARIES)`` (1,000 by default).
Each round the canaries take part as the config's clients do (its sampler),
sending clipped random directions; at the end the runner compares the
final model's change with them and writes the estimate (Andrew et al.
2024) and the one-run lower bound (Steinke et al. 2023) to
``privacy.json`` and the last metrics row, beside the accountant's
epsilon (``fedjx.algorithms.privacy.audit``, docs/privacy.md, which has the
results of each).
"""

import os

from fedjx.experiments import cli

CONFIGS = ('dp_fedavg_digits', 'dp_adaptive_digits', 'dp_ftrl_digits',
           'dp_fedadam_digits', 'dp_diloco_digits')


def get_config(arg='dp_fedavg_digits'):
  name, _, count = arg.partition(',')
  if name not in CONFIGS or (count and not count.isdigit()):
    raise ValueError(f'dp_audit.py: arg={arg!r}; give CONFIG[,CANARIES] with '
                     f'CONFIG in {CONFIGS} and CANARIES a whole number.')
  config = cli.load_config_file(
      os.path.join(os.path.dirname(os.path.abspath(__file__)), f'{name}.py'))
  config.privacy.audit = dict(canaries=int(count or 1000))
  return config
