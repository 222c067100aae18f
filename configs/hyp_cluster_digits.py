"""HypCluster on scikit-learn's digits: three cluster models, each client trains the best.

Mansour, Mohri, Ro, Suresh 2020 ("Three Approaches for Personalization with
Applications to Federated Learning"), HypCluster: the server keeps K = 3
models; each sampled client takes the one of lowest loss on its data and
trains it (one local epoch of SGD), and each model is the weighted mean of
its clients' (server SGD, learning rate 1). The clusters start from the one
initial model, clusters 1 and 2 spread from it by Gaussian noise of standard
deviation 0.01. Data, model, cohort and client learning rate as
``configs/fedavg_digits.py`` (50 non-IID clients, 10 a round, batch 10). Not
tuned. The central evaluation reads the model of the cluster with the most
examples in the last round; the metrics count the clients of each cluster
(``cluster_clients_<k>``).

  fedjx-run --config configs/hyp_cluster_digits.py --workdir runs/hyp_cluster
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 150
  config.cohort_size = 10
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.checkpoint_every = 50
  config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='hyp_cluster', num_clusters=3, init_noise=0.01,
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
