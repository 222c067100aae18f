"""DiLoCo with eager updates (Kale et al. 2025) on the standard library's source.

The DiLoCo config's data, model, inner and outer optimizers, with the
outer gradients' all-reduce overlapped with the whole next inner phase
(the 1-outer-step overlap): each replica steps on the average sent one
round earlier, its own stale term replaced by its fresh one.
``--config.algorithm.outer_update=delayed`` steps on the delayed average
alone (the naive delayed outer gradients the paper compares against).

  fedjx-run --config configs/eager_diloco_text.py --workdir runs/eager_diloco
"""

import importlib.util
import os

from fedjx.experiments.config_base import optimizer

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    'diloco_text', os.path.join(_here, 'diloco_text.py'))
_diloco = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_diloco)


def get_config(replicas: str = '4'):
  config = _diloco.get_config(replicas)
  config.algorithm = dict(
      name='eager_diloco', outer_update='eager',
      inner_optimizer=optimizer('adamw', learning_rate=3e-3, b1=0.9, b2=0.95,
                                weight_decay=0.1),
      outer_optimizer=optimizer('sgd', learning_rate=0.7, momentum=0.9,
                                nesterov=True))
  return config
