"""Flax models and their per-example losses and metrics.

Each builder returns a :class:`Model`: ``model.init(key, batch)`` gives the
parameters, ``model.loss_fn(params, batch) -> [B]`` and
``model.metrics_fn(params, batch) -> {'accuracy': [B]}`` are what algorithms
consume (docs/interfaces.md).

========================  =================================================
builder                   model
========================  =================================================
``logistic_regression``   softmax regression
``mlp``                   multi-layer perceptron
``emnist_cnn``            the 1.2M-parameter EMNIST CNN of Reddi et al. 2021
``resnet``                small ResNet with GroupNorm (ResNet-18 by options)
``transformer_lm``        decoder-only transformer language model
``llama_lm``              Llama-family decoder, presets 500k-2.4B (llama_config)
``lstm_lm``               LSTM language model (Shakespeare, Stack Overflow)
========================  =================================================
"""

from fedjx.models.cnn import EmnistCNN
from fedjx.models.cnn import emnist_cnn
from fedjx.models.linear import LogisticRegression
from fedjx.models.linear import logistic_regression
from fedjx.models.llama import LlamaLM
from fedjx.models.llama import llama_lm
from fedjx.models.llama_config import LlamaConfig
from fedjx.models.losses import Model
from fedjx.models.losses import accuracy
from fedjx.models.losses import batch_rng
from fedjx.models.losses import masked_sequence_mean
from fedjx.models.losses import softmax_cross_entropy
from fedjx.models.perceptron import MLP
from fedjx.models.perceptron import mlp
from fedjx.models.precision import mixed_precision
from fedjx.models.residual import ResNet
from fedjx.models.residual import resnet
from fedjx.models.rnn import LSTMLanguageModel
from fedjx.models.rnn import lstm_lm
from fedjx.models.transformer import TransformerLM
from fedjx.models.transformer import transformer_lm

__all__ = [
    'EmnistCNN',
    'LSTMLanguageModel',
    'LlamaConfig',
    'LlamaLM',
    'LogisticRegression',
    'MLP',
    'Model',
    'ResNet',
    'TransformerLM',
    'accuracy',
    'batch_rng',
    'emnist_cnn',
    'llama_lm',
    'logistic_regression',
    'lstm_lm',
    'masked_sequence_mean',
    'mixed_precision',
    'mlp',
    'resnet',
    'softmax_cross_entropy',
    'transformer_lm',
]
