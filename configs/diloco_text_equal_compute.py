"""DiLoCo against data-parallel training at equal compute, on the stdlib text.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models" (arXiv 2311.08105), Figure 3 / Table 4: ``K`` replicas
each take ``H`` inner AdamW steps of batch ``B`` between outer syncs, against
one data-parallel model trained with batch ``K * B`` that synchronizes
every step. Both take the same ``T`` optimizer steps on the same ``T * K * B``
examples (the same inner-step FLOPs); DiLoCo communicates ``T / H`` times,
data-parallel ``T`` times.

The config argument chooses the arm:

* ``:H`` (an int, e.g. ``:500``): DiLoCo with ``K = 4`` replicas of batch
  ``B = 4`` on IID shards, ``H`` inner steps per round and ``T / H`` rounds
  (``H`` must divide ``T``); outer Nesterov SGD (learning rate 0.7,
  momentum 0.9, the paper's) unless swept.
* ``:dp``: data-parallel training, one replica of batch ``K * B = 16`` on
  all the training data. Averaging ``K`` replicas' gradients of batch ``B``
  every step is one step of batch ``K * B``, and one replica whose outer step
  is SGD with learning rate 1 and no momentum (while its AdamW state
  persists, as in DiLoCo) sets the model to the replica's: the run is plain
  AdamW with batch ``K * B`` for ``T`` steps. It runs in rounds of 50 steps
  only to evaluate every 100 steps; the rounds are not communications.

Scale (a 2-core CPU): a byte-level transformer LM of width 32, 2 layers and
4 heads (43k parameters) on sequences of 32 bytes, ``T = 2000`` inner steps
(32k training sequences, 0.69 epoch of the 46k-sequence training set; each
round draws its batches from a fresh shuffle of the replica's shard),
held-out loss on the first 512 of the
5,134 held-out sequences. This is about 3,500 times fewer parameters than
the paper's 150M-parameter model and 44 times fewer steps than its 88k;
only the direction of the effect is comparable.

  fedjx-sweep --config configs/diloco_text_equal_compute.py:500 ...
  fedjx-sweep --config configs/diloco_text_equal_compute.py:dp ...

(``docs/reproductions.md`` and ``scripts/reproductions.sh`` give the full
commands.)
"""

from fedjx.experiments.config_base import base_config, optimizer

MODULES = ('json', 'email', 'asyncio', 'collections', 'logging', 'http',
           'concurrent', 'importlib')
REPLICAS = 4          # K
BATCH_SIZE = 4        # B, per replica
TOTAL_STEPS = 2000    # T, inner steps of every replica
DP_STEPS_PER_ROUND = 50
DP_EVAL_EVERY_STEPS = 100


def get_config(arm: str = '500'):
  if arm == 'dp':
    replicas, batch_size, steps = 1, REPLICAS * BATCH_SIZE, DP_STEPS_PER_ROUND
  else:
    try:
      steps = int(arm)
    except ValueError:
      raise ValueError(f'config argument {arm!r}: give H, inner steps per '
                       f'round dividing {TOTAL_STEPS} (e.g. 500), or "dp".'
                       ) from None
    if steps < 1 or TOTAL_STEPS % steps:
      raise ValueError(f'config argument H={steps}: H must be a positive '
                       f'divisor of T={TOTAL_STEPS} (e.g. 16, 50, 125, 500).')
    replicas, batch_size = REPLICAS, BATCH_SIZE
  rounds = TOTAL_STEPS // steps
  config = base_config()
  config.seed = 0
  config.rounds = rounds
  config.cohort_size = replicas            # every replica, every round
  config.batch_size = batch_size
  config.local_steps = steps               # H inner steps per round
  config.bucket_steps = False
  config.eval_every = (DP_EVAL_EVERY_STEPS // steps if arm == 'dp'
                       else rounds)
  config.eval_batch_size = 256
  config.eval_max_examples = 512
  config.checkpoint_every = max(1, rounds // 2)
  config.dataset = dict(name='text', seq_len=32, level='byte',
                        modules=MODULES, num_shards=replicas,
                        test_fraction=0.1)
  config.model = dict(name='transformer_lm', width=32, num_layers=2,
                      num_heads=4)
  if arm == 'dp':
    outer = optimizer('sgd', learning_rate=1.0, momentum=0.0, nesterov=True)
  else:
    outer = optimizer('sgd', learning_rate=0.7, momentum=0.9, nesterov=True)
  config.algorithm = dict(
      name='diloco',
      inner_optimizer=optimizer('adamw', learning_rate=3e-3, b1=0.9, b2=0.95,
                                weight_decay=0.1),
      outer_optimizer=outer)
  return config
