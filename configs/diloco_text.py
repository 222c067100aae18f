"""DiLoCo on the standard library's source: K data-parallel replicas.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models". The byte-level sequences (length 64) of eight standard
library packages are pooled and split IID into K shards, one per replica.
Each round every replica runs H = 16 AdamW steps from the shared model, and
the averaged outer gradient (old - new parameters) updates the shared model
with Nesterov SGD (learning rate 0.7, momentum 0.9), as in the paper.

The config argument sets K; K = 1 is the one-replica baseline at equal
communication rounds (same H, same rounds, one replica's compute):

  fedjx-run --config configs/diloco_text.py --workdir runs/diloco_k4
  fedjx-run --config configs/diloco_text.py:1 --workdir runs/diloco_k1
"""

from fedjx.experiments.config_base import base_config, optimizer

MODULES = ('json', 'email', 'asyncio', 'collections', 'logging', 'http',
           'concurrent', 'importlib')


def get_config(replicas: str = '4'):
  replicas = int(replicas)
  config = base_config()
  config.seed = 0
  config.rounds = 40
  config.cohort_size = replicas          # every replica, every round
  config.batch_size = 8
  config.local_steps = 16                # H inner steps per round
  config.bucket_steps = False
  config.eval_every = 5
  config.eval_batch_size = 128
  config.eval_max_examples = 1024
  config.checkpoint_every = 20
  config.dataset = dict(name='text', seq_len=64, level='byte',
                        modules=MODULES, num_shards=replicas,
                        test_fraction=0.1)
  config.model = dict(name='transformer_lm', width=64, num_layers=2,
                      num_heads=4)
  config.algorithm = dict(
      name='diloco',
      inner_optimizer=optimizer('adamw', learning_rate=3e-3, b1=0.9, b2=0.95,
                                weight_decay=0.1),
      outer_optimizer=optimizer('sgd', learning_rate=0.7, momentum=0.9,
                                nesterov=True))
  return config
