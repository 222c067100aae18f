"""The DiLoCo scaling-study recipe at CPU scale: M replicas against data-parallel.

Charles et al. 2025, "Communication-Efficient Language Model Training Scales
Reliably and Robustly: Scaling Laws for DiLoCo" (arXiv 2503.09799), compare
DiLoCo with ``M`` replicas against data-parallel training of the same Llama
model on the same tokens, with the global batch (sequences per inner step
over all replicas) held fixed as ``M`` changes. This config is that
comparison on a byte-level Llama preset (``fedjx.models.llama_config``:
``'500k'``, ``'1m'``, ``'2m'``) and the offline standard-library corpus
(``dataset.name='text'``, every module, sequences of the preset's ``T = 128``
bytes, pooled and dealt IID into ``M`` shards, 10 % held out).

The byte-level presets run on a CPU. ``'35m'`` and ``'180m'`` (the
study's smallest sizes, sequences of 2,048 tokens, computed in bfloat16 over
float32 parameters) are for one accelerator: on a 16 GB TPU v5e chip M = 4
and M = 8 replicas of 35M and M = 4 of 180M fit, the replicas' AdamW
states held on the chip and the replicas trained one after another
(docs/scaling.md); there the attention kernel and each layer's
rematerialization are chosen from the chip's memory left by those states.
M = 8 of 180M runs with the states on the host
(``--config.client_state.placement=store --config.execution=streaming
--config.client_state.memory_budget_mb=16000``).

The argument is ``"M,preset"`` or ``"M,preset,tokens_per_param"``:

* ``M >= 1``: DiLoCo. Each round every replica takes ``H = 30`` inner AdamW
  steps of ``GLOBAL_BATCH / M`` sequences from the shared model (its AdamW
  state persists across rounds); the averaged outer gradient updates the
  shared model with SGD with Nesterov momentum (learning rate 0.7, momentum
  0.9: Douillard et al. 2023, arXiv 2311.08105, the values this framework's
  DiLoCo defaults to; Charles et al. 2025 tune the outer learning rate per
  ``M``, and their tuned values are not reproduced here).
* ``M = 0``: the data-parallel baseline of the same family, one replica
  training with the whole global batch, synchronized every step: AdamW
  only. One replica whose outer step is SGD with learning rate 1 and no
  momentum sets the model to the replica's after every round, so the run is
  plain AdamW on ``GLOBAL_BATCH`` sequences per step; its rounds of ``H``
  steps are not communications, they only line its schedule and its
  evaluations up with DiLoCo's.

Inner optimizer: AdamW with ``b1 = 0.9``, ``b2 = 0.99`` (as
``fedjx.experiments.lm_cost`` takes Charles et al. 2025's inner optimizer)
and weight decay 0.1 at the peak learning rate ``PEAK_LR``. The paper's
inner steps also warm the learning rate up and decay it along a cosine, and
clip the gradients. A config cannot say either for the registered
``'diloco'``: optimizer specs take numbers, not schedules, and
``hparam_schedules`` is not one of DiLoCo's options. The study therefore
runs :func:`recipe_algorithm`'s ``'diloco_recipe'``
(:mod:`fedjx.algorithms.diloco_recipe_lib`): the same AdamW on gradients clipped
to global norm ``CLIP_NORM`` = 1.0, with a linear warmup over the first 10 %
of the inner steps and a cosine decay to 5 % of ``PEAK_LR`` at the last one,
a schedule of each replica's own inner step count (which persists across
rounds). The
peak learning rate, the warmup length and the global batch are chosen for
these byte-level models, not tuned per ``M`` as the paper tunes them; the
paper's exact weight decay and warmup length were not checked against its
text here.

Token budget: ``D = tokens_per_param * N`` (default 20, Chinchilla: Hoffmann
et al. 2022, arXiv 2203.15556), ``N`` from
``fedjx.models.llama_config.num_params``; the rounds are
``R = max(1, round(D / (GLOBAL_BATCH * T * H)))``, the same for every ``M``,
so every arm trains on ``R H GLOBAL_BATCH T`` tokens.

Every round reports ``pseudo_grad_norm`` (the averaged outer gradient's
norm) and ``communicated_bytes`` (the outer step's upload), with
``'diloco_recipe'`` also ``inner_grad_norm`` (the mean inner gradient norm
before clipping); the run's rows add ``tokens_per_s`` and ``mfu``
(``fedjx.experiments.lm_metrics``). ``fedjx-run`` runs it:

  fedjx-run --config configs/diloco_study.py:4,500k --workdir runs/study_m4
  fedjx-run --config configs/diloco_study.py:0,500k --workdir runs/study_dp
  fedjx-run --config configs/diloco_study.py:8,1m,2 --workdir runs/study_m8_1m
"""

from __future__ import annotations

from fedjx.experiments.config_base import base_config
from fedjx.models import llama_config

GLOBAL_BATCH = 32         # sequences per inner step, over all replicas
INNER_STEPS = 30          # H
PEAK_LR = 3e-3
FINAL_LR_FRACTION = 0.05  # cosine decay to 5 % of the peak
WARMUP_FRACTION = 0.1     # of the inner steps
CLIP_NORM = 1.0
TOKENS_PER_PARAM = 20.0   # Chinchilla
PRESETS = ('500k', '1m', '2m', '35m', '180m')
CHIP_PRESETS = ('35m', '180m')  # bfloat16 compute, sequences of 2,048: one accelerator
EVAL_EXAMPLES = 1024


def parse(arg: str) -> tuple[int, str, float]:
  """``(M, preset, tokens_per_param)`` from ``"M,preset[,tokens_per_param]"``."""
  parts = arg.split(',')
  if len(parts) not in (2, 3):
    raise ValueError(f'diloco_study: argument {arg!r} must be "M,preset" or '
                     '"M,preset,tokens_per_param" (e.g. "4,500k" or "0,1m,2").')
  try:
    replicas = int(parts[0])
  except ValueError:
    raise ValueError(f'diloco_study: M={parts[0]!r} must be an integer >= 0 '
                     '(0: data-parallel).') from None
  if replicas < 0 or (replicas and GLOBAL_BATCH % replicas):
    raise ValueError(f'diloco_study: M={replicas} must be 0 (data-parallel) or a '
                     f'divisor of the global batch {GLOBAL_BATCH}.')
  preset = parts[1]
  if preset not in PRESETS:
    raise ValueError(f'diloco_study: preset={preset!r} is not one of {PRESETS}.')
  tokens_per_param = TOKENS_PER_PARAM
  if len(parts) == 3:
    try:
      tokens_per_param = float(parts[2])
    except ValueError:
      tokens_per_param = -1.0
    if not tokens_per_param > 0:
      raise ValueError(f'diloco_study: tokens_per_param={parts[2]!r} must be a '
                       'positive number.')
  return replicas, preset, tokens_per_param


def num_rounds(preset: str, tokens_per_param: float) -> int:
  """``R = max(1, round(tokens_per_param N / (GLOBAL_BATCH T H)))``."""
  seq_len = llama_config.preset(preset).seq_len
  tokens_per_round = GLOBAL_BATCH * seq_len * INNER_STEPS
  return max(1, round(tokens_per_param * llama_config.num_params(preset) /
                      tokens_per_round))


def get_config(arg: str = '4,500k'):
  replicas, preset, tokens_per_param = parse(arg)
  rounds = num_rounds(preset, tokens_per_param)
  seq_len = llama_config.preset(preset).seq_len
  config = base_config()
  config.seed = 0
  config.rounds = rounds
  config.cohort_size = max(replicas, 1)        # every replica, every round
  config.batch_size = GLOBAL_BATCH // max(replicas, 1)
  config.local_steps = INNER_STEPS
  config.bucket_steps = False
  config.eval_every = max(1, rounds // 2)
  config.eval_batch_size = 256
  config.eval_max_examples = EVAL_EXAMPLES
  config.checkpoint_every = rounds
  config.dataset = dict(name='text', seq_len=seq_len, level='byte', modules=None,
                        num_shards=max(replicas, 1), test_fraction=0.1)
  config.model = dict(name='llama_lm', preset=preset)
  if preset in CHIP_PRESETS:
    config.model.dtype = 'bfloat16'
    config.eval_max_examples = EVAL_EXAMPLES // 4
  config.algorithm = recipe_algorithm(rounds, INNER_STEPS, replicas)
  return config


def recipe_algorithm(rounds: int, inner_steps: int, replicas: int) -> dict:
  """``config.algorithm``: ``'diloco_recipe'``
  (:func:`fedjx.algorithms.diloco_recipe`) for ``rounds`` of
  ``inner_steps``: AdamW (``b1 = 0.9``, ``b2 = 0.99``, weight decay 0.1) at
  ``PEAK_LR`` with a warmup over ``WARMUP_FRACTION`` of the inner steps and a
  cosine decay to ``FINAL_LR_FRACTION``, gradients clipped at ``CLIP_NORM``;
  outer Nesterov 0.7 / 0.9, or for ``replicas = 0`` outer SGD 1.0 without
  momentum (plain AdamW). No evaluation of each replica's data before and
  after its steps (two more forward passes per round): the rows report the
  inner steps' own training loss (``train_loss_during``).
  """
  total_steps = rounds * inner_steps
  return dict(
      name='diloco_recipe', peak_learning_rate=PEAK_LR,
      warmup_steps=max(1, round(WARMUP_FRACTION * total_steps)),
      total_steps=total_steps, final_lr_fraction=FINAL_LR_FRACTION, b1=0.9, b2=0.99,
      weight_decay=0.1, clip_norm=CLIP_NORM,
      outer_learning_rate=0.7 if replicas else 1.0,
      outer_momentum=0.9 if replicas else 0.0, client_evaluation=False)
