"""Asynchronous DiLoCo on the standard library's source: replicas of unequal speed.

DiLoCo (Douillard et al. 2023) with K replicas of which two are slow, run
asynchronously as in Liu et al. 2024, "Asynchronous Local-SGD Training for
Language Modeling": every replica always trains (concurrency = K); an outer
step is taken as soon as one replica reports (``cohort_size`` 1), weighting
its outer gradient by 1 / sqrt(1 + staleness); the outer optimizer is
Delayed Nesterov (learning rate 0.7, momentum 0.9), whose momentum moves
once every K outer steps from the mean of the K outer gradients received
meanwhile; each outer gradient is applied once, at 1/K, as it arrives, and
the momentum term is spread evenly over the K steps (momentum activation
c = 1/K). Data, model and inner AdamW are those of
``diloco_text.py``; one outer step here is one replica's H = 16 inner steps,
so 4 x 40 outer steps are the inner work of 40 synchronous DiLoCo rounds.
Replica k's H steps take 60, 60, 120 and 240 s (k = 0..3, repeating), so
the metrics' ``simulated_time`` compares with synchronous DiLoCo waiting
240 s a round.

  fedjx-run --config configs/async_diloco_text.py --workdir runs/async_diloco_k4
"""

from fedjx.experiments.config_base import base_config, optimizer

# The packages of diloco_text.py.
MODULES = ('json', 'email', 'asyncio', 'collections', 'logging', 'http',
           'concurrent', 'importlib')


def get_config(replicas: str = '4'):
  replicas = int(replicas)
  config = base_config()
  config.seed = 0
  config.rounds = 40 * replicas          # outer steps of one replica each
  config.cohort_size = 1                 # outer gradients per outer step
  config.batch_size = 8
  config.local_steps = 16                # H inner steps per job
  config.bucket_steps = False
  config.eval_every = 20
  config.eval_batch_size = 128
  config.eval_max_examples = 1024
  config.checkpoint_every = 40
  config.dataset = dict(name='text', seq_len=64, level='byte',
                        modules=MODULES, num_shards=replicas,
                        test_fraction=0.1)
  config.model = dict(name='transformer_lm', width=64, num_layers=2,
                      num_heads=4)
  config.algorithm = dict(
      name='async_diloco',
      concurrency=replicas,
      client_durations=dict(
          name='fixed',
          seconds=tuple(60.0 * (1, 1, 2, 4)[k % 4] for k in range(replicas))),
      max_staleness=4 * replicas,
      delay_period=replicas, momentum_activation=1.0 / replicas,
      inner_optimizer=optimizer('adamw', learning_rate=3e-3, b1=0.9, b2=0.95,
                                weight_decay=0.1),
      outer_learning_rate=0.7, outer_momentum=0.9)
  return config
