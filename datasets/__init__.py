"""Group-structured federated datasets and cohorts: ``fedjx.datasets``.

A :class:`FederatedDataset` is a population of clients, each a dict of NumPy
arrays sharing a leading example axis, read lazily one client at a time.

Building populations:

* in memory: :func:`from_arrays` grouped by a feature or by index groups from
  :func:`partition_iid`, :func:`partition_dirichlet` (label skew, Hsu et al.
  2019), :func:`partition_quantity_skew` (lognormal / power-law sizes) or
  :func:`partition_by_feature` (natural groups);
* TensorFlow Datasets: :func:`from_tfds` (``tfds.data_source``, ArrayRecord,
  no TensorFlow);
* offline, no download: :func:`load_digits` (scikit-learn's digits),
  :func:`synthetic` (Synthetic(alpha, beta) of FedProx, Li et al. 2020,
  generated per client on demand), :func:`text_corpus` (Python's standard
  library source, one client per module);
* files: :func:`read_tff_hdf5` (TensorFlow Federated HDF5) and
  :func:`read_fedjax_sqlite` (FedJAX SQLite), with writers for both.

Rounds: :class:`CohortSampler` picks clients per round from ``(seed, round)``
(uniformly without replacement; :class:`PoissonSampler` and
:class:`EpochSampler` draw the cohorts that private training accounts for,
see ``docs/privacy.md``);
:func:`make_cohort` batches them into a :class:`Cohort` of ``[C, S, B, ...]``
arrays with a mask, padded to power-of-two step buckets; :func:`place_cohort`
shards it ``P('clients')`` on a mesh; :func:`cohort_iterator` does all three
for consecutive rounds with background prefetch.

Unreliable clients: :mod:`fedjx.datasets.systems`, a :class:`SystemModel`
of availability, dropout, speed and deadlines on a simulated clock, and
:func:`system_cohort_iterator`, the cohorts the server really aggregates.

Asynchronous training: :class:`AsyncScheduler` simulates which clients
report at each server step of buffered asynchronous aggregation (FedBuff)
and when; :func:`async_cohort_iterator` turns its steps into cohorts.

Interpreters: :func:`beam_client_data` and :func:`streaming_clients` give a
dataset's clients to Beam (``fedjx.beam.run``) and to streaming
(``fedjx.streaming.run``), batched where they are read.

Labels: :func:`check_labels` makes a label outside ``[0, num_classes)`` a
one-line error when the data is read.

Evaluation: :func:`split_clients`, :func:`split_examples`,
:func:`eval_batches`, :func:`evaluate` (the example-weighted means of a
per-example function over held-out examples), :func:`eval_cohorts`; per-client train / held-out
splits for personalization: :func:`client_splits`. Partition statistics:
:func:`summary`, :func:`format_summary`.
"""

from fedjx.datasets.async_schedule import AsyncScheduler
from fedjx.datasets.async_schedule import async_cohort_iterator
from fedjx.datasets.async_schedule import lognormal_durations
from fedjx.datasets.splits import ClientSplits
from fedjx.datasets.splits import client_splits
from fedjx.datasets.cohort import Cohort
from fedjx.datasets.cohort import CohortSampler
from fedjx.datasets.cohort import PADDING_CLIENT
from fedjx.datasets.cohort import PaddedCohortWarning
from fedjx.datasets.cohort import Sampler
from fedjx.datasets.cohort import padded_ids
from fedjx.datasets.cohort import bucket_steps
from fedjx.datasets.cohort import cohort_steps
from fedjx.datasets.cohort import local_client_slice
from fedjx.datasets.cohort import make_cohort
from fedjx.datasets.cohort import place_local_cohort
from fedjx.datasets.cohort import place_cohort
from fedjx.datasets.digits import load_digits
from fedjx.datasets.evaluation import eval_batches
from fedjx.datasets.evaluation import eval_cohorts
from fedjx.datasets.evaluation import evaluate
from fedjx.datasets.evaluation import split_clients
from fedjx.datasets.evaluation import split_examples
from fedjx.datasets.federated import FederatedDataset
from fedjx.datasets.federated import IndexedDataset
from fedjx.datasets.federated import from_arrays
from fedjx.datasets.device_data import DeviceDataset
from fedjx.datasets.device_data import on_device
from fedjx.datasets.interpreter_clients import CohortLoader
from fedjx.datasets.interpreter_clients import beam_client_data
from fedjx.datasets.interpreter_clients import streaming_clients
from fedjx.datasets.files import read_fedjax_sqlite
from fedjx.datasets.files import read_tff_hdf5
from fedjx.datasets.files import write_fedjax_sqlite
from fedjx.datasets.files import write_tff_hdf5
from fedjx.datasets.labels import LabelCheckedDataset
from fedjx.datasets.labels import check_labels
from fedjx.datasets.poisoning import PoisonedDataset
from fedjx.datasets.partition import partition_by_feature
from fedjx.datasets.partition import partition_dirichlet
from fedjx.datasets.partition import partition_iid
from fedjx.datasets.partition import partition_quantity_skew
from fedjx.datasets.partition import quantity_skew_sizes
from fedjx.datasets.prefetch import Prefetcher
from fedjx.datasets.prefetch import cohort_for_round
from fedjx.datasets.prefetch import cohort_iterator
from fedjx.datasets.sampling import EpochSampler
from fedjx.datasets.sampling import PoissonSampler
from fedjx.datasets.sampling import poisson_bucket
from fedjx.datasets.statistics import format_summary
from fedjx.datasets.statistics import summary
from fedjx.datasets.synthetic_data import SyntheticDataset
from fedjx.datasets.synthetic_data import synthetic
from fedjx.datasets import poisoning
from fedjx.datasets import systems
from fedjx.datasets.systems import AvailableSampler
from fedjx.datasets.systems import RoundReport
from fedjx.datasets.systems import SystemModel
from fedjx.datasets.systems import system_cohort_iterator
from fedjx.datasets.text import TextCorpus
from fedjx.datasets.text import text_corpus
from fedjx.datasets.tfds_source import from_tfds

__all__ = [
    'AsyncScheduler',
    'async_cohort_iterator',
    'lognormal_durations',
    'ClientSplits',
    'Cohort',
    'DeviceDataset',
    'CohortLoader',
    'CohortSampler',
    'EpochSampler',
    'PoissonSampler',
    'PADDING_CLIENT',
    'PaddedCohortWarning',
    'Sampler',
    'padded_ids',
    'AvailableSampler',
    'RoundReport',
    'SystemModel',
    'FederatedDataset',
    'IndexedDataset',
    'LabelCheckedDataset',
    'PoisonedDataset',
    'Prefetcher',
    'SyntheticDataset',
    'TextCorpus',
    'beam_client_data',
    'bucket_steps',
    'check_labels',
    'cohort_for_round',
    'cohort_iterator',
    'eval_batches',
    'eval_cohorts',
    'evaluate',
    'format_summary',
    'from_arrays',
    'on_device',
    'from_tfds',
    'load_digits',
    'make_cohort',
    'partition_by_feature',
    'partition_dirichlet',
    'partition_iid',
    'partition_quantity_skew',
    'place_cohort',
    'place_local_cohort',
    'poisson_bucket',
    'poisoning',
    'cohort_steps',
    'local_client_slice',
    'quantity_skew_sizes',
    'read_fedjax_sqlite',
    'read_tff_hdf5',
    'client_splits',
    'split_clients',
    'split_examples',
    'streaming_clients',
    'summary',
    'synthetic',
    'system_cohort_iterator',
    'systems',
    'text_corpus',
    'write_fedjax_sqlite',
    'write_tff_hdf5',
]
