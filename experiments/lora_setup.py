"""``config.lora``: fine-tune a (pretrained) language model through LoRA adapters.

With ``config.lora.rank > 0`` the runner wraps the model of ``config.model``
in :func:`fedjx.models.lora.lora_model`: the base weights are frozen (loaded
from ``pretrained``, a Hugging Face ``LlamaForCausalLM`` folder, or drawn at
random when it is ``''``), and the algorithm's params are the adapters alone,
so every algorithm, aggregator (DP, compression, secure sums), byte count
and checkpoint applies to what is trained and sent. The aggregation rule is
the algorithm's: ``fedavg``/``fedadam`` on the adapters is FedIT (with
``train_a=False``, FFA-LoRA), ``algorithm.name='fedlora'`` with
``rule='flexlora' | 'flora' | 'hetlora'`` the others
(:mod:`fedjx.algorithms.fedlora_lib`).

Fields (:data:`LORA_DEFAULTS`): ``rank`` (0: off), ``alpha``, ``dropout``,
``targets``, ``a_init``, ``train_a``, ``base_dtype`` as
:class:`fedjx.models.lora_config.LoraConfig`; ``pretrained`` (a folder, or
``''``); ``export`` (True: at the end of a run that was not interrupted, the
adapters are written as a PEFT folder ``<workdir>/export/adapter`` and the
merged model as a Hugging Face folder ``<workdir>/export/merged``, for Llama
models). Under FLoRA, whose rounds merge into the base, the merged folder is
the trained model and the adapter folder holds the last round's adapters,
which apply to the base with those merges (not to the original checkpoint).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fedjx.experiments.errors import ConfigError

LORA_DEFAULTS: dict[str, Any] = {
    'rank': 0, 'alpha': 16.0, 'dropout': 0.0, 'targets': ('q_proj', 'v_proj'),
    'a_init': 'kaiming', 'train_a': True, 'base_dtype': 'float32',
    'pretrained': '', 'export': False,
}
_MODEL_FIELDS = ('rank', 'alpha', 'dropout', 'targets', 'a_init', 'train_a', 'base_dtype')


def section(config: Any) -> dict[str, Any]:
  """``config.lora`` with its defaults, every key known (ConfigError otherwise)."""
  given = config.get('lora', None) if hasattr(config, 'get') else None
  given = dict(given.to_dict() if hasattr(given, 'to_dict') else (given or {}))
  unknown = sorted(set(given) - set(LORA_DEFAULTS))
  if unknown:
    raise ConfigError(f'config.lora has unknown field(s) {unknown}; valid: '
                      f'{sorted(LORA_DEFAULTS)}.')
  return {**LORA_DEFAULTS, **given}


def lora_config_of(config: Any):
  """The :class:`~fedjx.models.lora_config.LoraConfig` of ``config.lora``, or None (rank 0)."""
  s = section(config)
  rank = s['rank']
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
    raise ConfigError(f'config.lora.rank={rank!r}; it must be an int >= 0 (0: no adapters).')
  if not isinstance(s['pretrained'], str):
    raise ConfigError(f"config.lora.pretrained={s['pretrained']!r}; give a folder or ''.")
  if s['export'] not in (True, False):
    raise ConfigError(f"config.lora.export={s['export']!r}; it must be True or False.")
  if rank == 0:
    if s['pretrained'] or s['export']:
      raise ConfigError('config.lora.pretrained and config.lora.export need '
                        'config.lora.rank > 0.')
    return None
  # Here, not at the top: fedjx.models imports JAX, which a config without
  # adapters does not need to be checked.
  from fedjx.models.lora_config import LoraConfig  # deferred: before JAX (usage errors, config checks)
  fields = {k: s[k] for k in _MODEL_FIELDS}
  if isinstance(fields['targets'], str):
    fields['targets'] = tuple(t for t in fields['targets'].split(',') if t)
  try:
    return LoraConfig(**fields)
  except ValueError as e:
    raise ConfigError(f'config.lora: {e}') from None


def pretrained_model(config: Any, model: Any, info: Mapping[str, Any]) -> tuple[Any, Any]:
  """``(model, base params)``: the checkpoint of ``config.lora.pretrained``, or ``(model, None)``.

  The checkpoint's ``config.json`` fixes the architecture (it replaces
  ``config.model.preset``); ``config.model`` may still set ``dtype``,
  ``remat``, ``scan_layers`` and ``pad_id``.
  """
  folder = section(config)['pretrained']
  if not folder:
    return model, None
  from fedjx.models import hf_checkpoint  # deferred: before JAX (usage errors, config checks)
  from fedjx.models import llama  # deferred: before JAX (usage errors, config checks)
  if config.model.name != 'llama_lm':
    raise ConfigError(f'config.lora.pretrained={folder!r} loads a Llama checkpoint; set '
                      f"config.model.name='llama_lm' (not {config.model.name!r}).")
  spec = config.model.to_dict() if hasattr(config.model, 'to_dict') else dict(config.model)
  extra = sorted(set(spec) - {'name', 'preset', 'dtype', 'remat', 'scan_layers', 'pad_id'})
  if extra:
    raise ConfigError(f'config.model sets {extra}, which the checkpoint of '
                      f'config.lora.pretrained={folder!r} fixes; set only dtype, remat, '
                      'scan_layers, pad_id (the preset is replaced).')
  try:
    shape, params = hf_checkpoint.load_pretrained(
        os.path.expanduser(folder), scan_layers=spec.get('scan_layers', True),
        dtype=spec.get('dtype'))
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f'config.lora.pretrained: {e}') from None
  if 'remat' in spec:
    shape = shape.replace(remat=spec['remat'])
  vocab = info.get('vocab_size')
  if vocab is not None and vocab > shape.vocab_size:
    raise ConfigError(f'config.lora.pretrained={folder!r} has a vocabulary of '
                      f'{shape.vocab_size} tokens but the dataset\'s tokenizer uses {vocab}; '
                      "give the dataset the checkpoint's tokenizer.json.")
  return llama.llama_lm(shape, pad_id=spec.get('pad_id', info.get('pad_id', 0))), params


def adapt(config: Any, model: Any, info: Mapping[str, Any], batch: Any, key: Any) -> Any:
  """``model`` with adapters by ``config.lora`` (``model`` itself when rank is 0)."""
  lora_config = lora_config_of(config)
  if lora_config is None:
    return model
  from fedjx.models import lora  # deferred: before JAX (usage errors, config checks)
  model, base_params = pretrained_model(config, model, info)
  try:
    return lora.lora_model(model, lora_config, key, batch, base_params)
  except ValueError as e:
    raise ConfigError(f'config.lora: {e}') from None


def export(config: Any, model: Any, params: Any, workdir: str) -> list[str]:
  """Writes ``<workdir>/export/adapter`` (PEFT) and ``.../merged`` (Hugging Face); their paths.

  Only when ``config.lora.export`` is set (else nothing; ``[]``).
  """
  s = section(config)
  if not s['export']:
    return []
  import jax  # deferred: before JAX (usage errors, config checks)
  from fedjx.models import hf_checkpoint  # deferred: before JAX (usage errors, config checks)
  from fedjx.models import llama  # deferred: before JAX (usage errors, config checks)
  from fedjx.models import peft_adapters  # deferred: before JAX (usage errors, config checks)
  base_module = model.base.module
  if not isinstance(base_module, llama.LlamaLM) or model.config.base_dtype == 'int8':
    raise ConfigError('config.lora.export writes Llama checkpoints with a float base; '
                      f'this model is {model.base.name!r} with base_dtype '
                      f'{model.config.base_dtype!r}.')
  # The frozen base (with FLoRA's merged deltas added: W + M) and the adapters.
  full = jax.device_get(model.full_params(params))
  out = os.path.join(workdir, 'export')
  adapter_dir, merged_dir = os.path.join(out, 'adapter'), os.path.join(out, 'merged')
  peft_adapters.export_peft(adapter_dir, full, rank=model.config.rank,
                            alpha=model.config.alpha, target_modules=model.config.targets,
                            base_model_name_or_path=s['pretrained'],
                            dropout=model.config.dropout)
  hf_checkpoint.save_pretrained(merged_dir, base_module.config, peft_adapters.merge_adapters(
      full, model.config.alpha, model.config.rank))
  return [adapter_dir, merged_dir]
