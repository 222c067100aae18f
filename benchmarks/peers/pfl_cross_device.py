"""pfl-research's FedAvg (``pfl.algorithm.FederatedAveraging``, PyTorch
backend, ``SimulatedBackend``) on the cross-device setups: the whole
population each round, example weighting, local SGD 0.1 for one epoch of
batch 10, central SGD 1.0, no evaluation; the models of
``torch_cross_device.py`` started from the setup's weights. One intra-op
thread (``--threads=0``: PyTorch's default).

  python pfl_cross_device.py --setup=2nn-1000 --rounds=3
"""

import common  # first: starts the clock

from importlib import metadata

import numpy as np
import torch

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

import cross_device as cd
import torch_cross_device as tcd


class _Net(torch.nn.Module):
  """A setup's model with the ``loss`` and ``metrics`` pfl-research wants."""

  def __init__(self, setup):
    super().__init__()
    layers = cd.init(setup)
    self.keys = ('tokens', 'y') if setup == 'logreg-sparse' else ('x', 'y')
    self.net = (tcd.TwoNN(layers) if cd.kind(setup) == '2nn'
                else tcd.LogReg(layers, setup == 'logreg-sparse'))
    tcd.load_init(self.net, layers, setup)

  def loss(self, *batch, eval=False):
    self.eval() if eval else self.train()
    return self.net(dict(zip(self.keys, batch)))

  @torch.no_grad()
  def metrics(self, *batch, eval=True):
    return {'loss': Weighted(float(self.loss(*batch, eval=True)) * len(batch[-1]),
                             len(batch[-1]))}


class _Clock(TrainingProcessCallback):

  def __init__(self, clock):
    self.clock = clock

  def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
    self.clock.tick()
    return False, Metrics()


def main():
  args = cd.parse_args(__doc__.split('\n')[0], lambda p: p.add_argument(
      '--threads', type=int, default=1, help='intra-op threads (0: default)'))
  if args.check:
    raise SystemExit('pfl_cross_device.py: pfl-research shuffles as it batches; '
                     'its round is not checked against the data-order reference.')
  if args.threads:
    torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  net = _Net(args.setup)
  data = {i: [torch.from_numpy(d[k]) for k in net.keys]
          for i, d in enumerate(cd.client_data(args.setup))}
  federated = FederatedDataset(
      make_dataset_fn=lambda uid: Dataset(raw_data=list(data[uid]), user_id=uid),
      user_sampler=get_user_sampler('minimize_reuse', list(data)),
      user_id_to_weight={uid: len(d[-1]) for uid, d in data.items()})
  assert sum(p.numel() for p in net.parameters()) == cd.num_params(args.setup)
  model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                       central_optimizer=torch.optim.SGD(net.parameters(), cd.SERVER_LR))
  backend = SimulatedBackend(training_data=federated, val_data=None,
                             postprocessors=[WeightByDatapoints()])
  clock = common.Clock()
  FederatedAveraging().run(
      algorithm_params=NNAlgorithmParams(
          central_num_iterations=args.rounds, evaluation_frequency=args.rounds + 1,
          train_cohort_size=len(data), val_cohort_size=0),
      backend=backend, model=model,
      model_train_params=NNTrainHyperParams(
          local_learning_rate=cd.LOCAL_LR, local_num_epochs=1,
          local_batch_size=cd.BATCH),
      model_eval_params=NNEvalHyperParams(local_batch_size=cd.BATCH),
      callbacks=[_Clock(clock)])
  cd.report('pfl-research', f"pfl {metadata.version('pfl')} (torch {torch.__version__})",
            args.setup, clock, {'torch_num_threads': torch.get_num_threads(),
                                'torch_num_interop_threads': torch.get_num_interop_threads()})


if __name__ == '__main__':
  main()
