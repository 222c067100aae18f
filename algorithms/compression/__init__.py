"""Compression: what clients send, in fewer bits.

* :mod:`~fedjx.algorithms.compression.compressors`: compressed aggregation
  (:class:`Compressor`, :func:`compressed_mean`; EDEN, DRIVE, QSGD, TernGrad,
  top-k, ...), each an aggregator with its bits counted;
* :mod:`~fedjx.algorithms.compression.quantization`: lossy number formats
  (:func:`quantize`);
* :mod:`~fedjx.algorithms.compression.outer`: compressed outer steps for
  DiLoCo (:func:`sparseloco`, :func:`muloco_quantized`);
* :mod:`~fedjx.algorithms.compression.dct`: DeMo's DCT-domain top-k of a
  decoupled momentum (:func:`demo`).

Modules and names are imported on first use.
"""

from fedjx import _lazy

MODULES = ('compressors', 'dct', 'outer', 'quantization')

# Each name, where it is defined.
_NAMES = {
    'compressed_mean': 'fedjx.algorithms.compression.compressors',
    'CompressionState': 'fedjx.algorithms.compression.compressors',
    'Compressor': 'fedjx.algorithms.compression.compressors',
    'COMPRESSORS': 'fedjx.algorithms.compression.compressors',
    'drive': 'fedjx.algorithms.compression.compressors',
    'eden': 'fedjx.algorithms.compression.compressors',
    'qsgd': 'fedjx.algorithms.compression.compressors',
    'random_k': 'fedjx.algorithms.compression.compressors',
    'sign_majority': 'fedjx.algorithms.compression.compressors',
    'stochastic_quantization': 'fedjx.algorithms.compression.compressors',
    'terngrad': 'fedjx.algorithms.compression.compressors',
    'top_k': 'fedjx.algorithms.compression.compressors',
    'uncompressed': 'fedjx.algorithms.compression.compressors',
    'demo': 'fedjx.algorithms.compression.dct',
    'muloco_quantized': 'fedjx.algorithms.compression.outer',
    'sparseloco': 'fedjx.algorithms.compression.outer',
    'quantize': 'fedjx.algorithms.compression.quantization',
}
__getattr__, __dir__ = _lazy.submodules(__name__, MODULES, _NAMES)

__all__ = [
    'COMPRESSORS', 'CompressionState', 'Compressor', 'compressed_mean', 'demo',
    'drive', 'eden', 'muloco_quantized', 'qsgd', 'quantize', 'random_k',
    'sign_majority', 'sparseloco', 'stochastic_quantization', 'terngrad',
    'top_k', 'uncompressed'
]
