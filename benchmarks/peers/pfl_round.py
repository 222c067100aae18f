"""pfl-research's FedAvg (``pfl.algorithm.FederatedAveraging``) with its
PyTorch backend on the peer setup, as its CIFAR-10 benchmark runs it:
``SimulatedBackend``, example weighting, local SGD 0.1 for 1 epoch of batch
10, central SGD 1.0, cohort 50, no evaluation.

  python pfl_round.py --setup=equal --rounds=3
"""

import common  # first: starts the clock

from importlib import metadata

import torch
from torch import nn

from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByDatapoints
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel

import torch_cnn


class _Net(nn.Module):
  """The CNN with the ``loss`` and ``metrics`` pfl-research's model wants."""

  def __init__(self):
    super().__init__()
    self.net = torch_cnn.simple_cnn()

  def forward(self, x):
    return self.net(x)

  def loss(self, x, y, eval=False):
    self.eval() if eval else self.train()
    return nn.functional.cross_entropy(self(x), y)

  @torch.no_grad()
  def metrics(self, x, y, eval=True):
    loss = nn.functional.cross_entropy(self(x), y, reduction='sum')
    return {'loss': Weighted(loss.item(), len(y))}


class _Clock(TrainingProcessCallback):

  def __init__(self, clock):
    self.clock = clock

  def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
    self.clock.tick()
    return False, Metrics()


def main():
  args = common.parse_args(__doc__.split('\n')[0])
  torch.manual_seed(0)
  data = {i: (torch_cnn.to_nchw(x), torch.from_numpy(y))
          for i, (x, y) in enumerate(common.client_data(args.setup))}
  federated = FederatedDataset(
      make_dataset_fn=lambda uid: Dataset(raw_data=list(data[uid]), user_id=uid),
      user_sampler=get_user_sampler('minimize_reuse', list(data)),
      user_id_to_weight={uid: len(y) for uid, (_, y) in data.items()})
  net = _Net()
  assert sum(p.numel() for p in net.parameters()) == common.NUM_PARAMS
  model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                       central_optimizer=torch.optim.SGD(net.parameters(),
                                                         common.SERVER_LR))
  backend = SimulatedBackend(training_data=federated, val_data=None,
                             postprocessors=[WeightByDatapoints()])
  clock = common.Clock()
  FederatedAveraging().run(
      algorithm_params=NNAlgorithmParams(
          central_num_iterations=args.rounds,
          evaluation_frequency=args.rounds + 1,
          train_cohort_size=common.COHORT, val_cohort_size=0),
      backend=backend, model=model,
      model_train_params=NNTrainHyperParams(
          local_learning_rate=common.LOCAL_LR, local_num_epochs=common.EPOCHS,
          local_batch_size=common.BATCH),
      model_eval_params=NNEvalHyperParams(local_batch_size=common.BATCH),
      callbacks=[_Clock(clock)])
  common.report('pfl-research', f"pfl {metadata.version('pfl')} (torch "
                f'{torch.__version__})', args.setup, clock, torch_cnn.threads())


if __name__ == '__main__':
  main()
