"""FedAvg on digits with compressed uploads: rotated stochastic quantization.

The quickstart (``configs/fedavg_digits.py``: 50 non-IID clients, 10 a
round, an MLP with 128 hidden units, client SGD 0.3, server SGD 2.0) whose
clients send their update quantized to ``bits`` bits per coordinate after
the shared randomised Hadamard rotation of Suresh, Yu, Kumar, McMahan,
"Distributed Mean Estimation with Limited Communication", ICML 2017
(``pi_srk``; :func:`fedjx.algorithms.compression.stochastic_quantization`).
Every round reports ``upload_bits`` and ``download_bits`` per client,
counted from the encoded messages. Any compressor of
``docs/communication.md`` takes the aggregator's place, e.g.
``--config.algorithm.aggregator="{'name': 'qsgd', 'levels': 4}"``.

  fedjx-run --config configs/compressed_fedavg_digits.py --workdir runs/sq2
  fedjx-run --config configs/compressed_fedavg_digits.py \\
      --config.algorithm.aggregator.bits=8 --workdir runs/sq8
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 100
  config.cohort_size = 10
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.checkpoint_every = 50
  config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='fedavg',
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=2.0),
      aggregator=dict(name='stochastic_quantization', bits=2, rotation=True))
  return config
