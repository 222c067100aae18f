"""Federated LoRA fine-tuning shaped like pfl-research's LLM benchmarks.

pfl-research's language-model benchmarks fine-tune TinyLlama-1.1B with LoRA
of rank 8, a cohort of 100 clients a round and an adaptive server: Adam
with learning rate 0.01, decayed by a cosine over the rounds (FedAdam on the
adapters, Reddi et al. 2021). Here the population is 200 clients drawn IID
from the built-in toy instruction set (no download), rendered with the
ChatML template, the loss on the responses only; the base is the 500k Llama
preset at random, so it runs on a CPU as it is: 30-50 s a round on 2 cores,
about half an hour for the 50 rounds; ``--config.rounds=3
--config.eval_every=3`` finishes in a few minutes. Clients run one local
epoch of SGD (learning rate 0.1) over their records in batches of 4. Give a
pretrained checkpoint and real data as in ``configs/flowertune_lora.py``,
and plan the 1.1B shape with

  fedjx-plan --preset tinyllama-1.1b --lora_rank 8 --lora_targets q_proj,k_proj,v_proj,o_proj --cohort 100
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 50
  config.cohort_size = 100
  config.batch_size = 4
  config.local_epochs = 1
  config.eval_every = 10
  config.eval_batch_size = 64
  config.eval_max_examples = 256
  config.checkpoint_every = 10
  config.dataset = dict(name='instructions', path='', template='chatml',
                        tokenizer='bytes', seq_len=96, partition='iid',
                        client_field=None, num_clients=200, num_records=2000,
                        test_fraction=0.2)
  config.model = dict(name='llama_lm', preset='500k')
  config.lora = dict(rank=8, alpha=16.0, targets=('q_proj', 'k_proj', 'v_proj', 'o_proj'))
  config.algorithm = dict(
      name='fedavg',
      client_optimizer=optimizer('sgd', learning_rate=0.1),
      server_optimizer=optimizer('adam', learning_rate=0.01, b1=0.9, b2=0.99, eps=1e-3),
      hparam_schedules={'server_optimizer/learning_rate': dict(
          name='cosine_decay_schedule', init_value=0.01, decay_steps=50)})
  return config
