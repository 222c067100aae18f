"""Streaming DiLoCo (Douillard et al. 2025) on the standard library's source.

The DiLoCo config's data, model and inner optimizer, with the parameters
split into P = 2 strided fragments synchronised in turn, outer gradients
quantised to 4 bits (e3m0) and merged with mixing factor 0.5. Each fragment
is merged at the end of its round; ``--config.algorithm.overlap_steps=TAU``
merges it ``TAU`` inner steps into the next round instead (the paper's
overlap of communication with computation, ``0 <= TAU <= 16``, the
round's inner steps).

  fedjx-run --config configs/streaming_diloco_text.py --workdir runs/sdiloco
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
      name='streaming_diloco', num_fragments=2, fragment_pattern='strided',
      quantization_format='e3m0', mixing_factor=0.5,
      inner_optimizer=optimizer('adamw', learning_rate=3e-3, b1=0.9, b2=0.95,
                                weight_decay=0.1),
      outer_optimizer=optimizer('sgd', learning_rate=0.7, momentum=0.9,
                                nesterov=True))
  return config
