"""Federated instruction tuning shaped like Flower's FlowerTune LLM leaderboard.

FlowerTune's general-NLP task: 20 clients holding IID shares of an
instruction set, 10 % of them (2) per round for 200 rounds, LoRA of rank 32
with alpha 64 on the attention projections, the adapters averaged (FedIT:
FedAvg on the adapters, Zhang et al. 2024, arXiv 2305.05644). Here the
clients hold the built-in toy instruction set (five learnable tasks; no
download) rendered with the Alpaca template, the loss on the response tokens
only, and the base is the 500k-parameter Llama preset drawn at random, so
the config runs on a laptop CPU as it is: 30-50 s a round on 2 cores, about
two hours for the 200 rounds; ``--config.rounds=3 --config.eval_every=3``
finishes in a few minutes. Point it at a pretrained model and real data
with

  fedjx-run --config configs/flowertune_lora.py --workdir runs/flowertune \\
    --config.lora.pretrained=/path/to/hf_llama_folder \\
    --config.dataset.path=/path/to/instructions.jsonl \\
    --config.dataset.tokenizer.kind=huggingface \\
    --config.dataset.tokenizer.file=/path/to/hf_llama_folder/tokenizer.json

(the checkpoint fixes the model's shape). Each client runs 10 AdamW steps
of batch 16 a round at learning rate 5e-4 (ours: the toy tasks and a random
base learn faster at that rate than at a pretrained model's 5e-5). At the
end the adapters are written as a PEFT folder and the merged model as a
Hugging Face folder under ``<workdir>/export``. Plan it at 1.1B or 7B with

  fedjx-plan --preset tinyllama-1.1b --lora_rank 32 --lora_targets q_proj,v_proj --cohort 2
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 200
  config.cohort_size = 2                  # 10 % of 20 clients
  config.batch_size = 16
  config.local_steps = 10
  config.bucket_steps = False
  config.eval_every = 20
  config.eval_batch_size = 64
  config.eval_max_examples = 256
  config.checkpoint_every = 50
  config.dataset = dict(name='instructions', path='', template='alpaca',
                        tokenizer='bytes', seq_len=192, partition='iid',
                        client_field=None, num_clients=20, num_records=1000,
                        test_fraction=0.1)
  config.model = dict(name='llama_lm', preset='500k')
  config.lora = dict(rank=32, alpha=64.0, dropout=0.05, targets=('q_proj', 'v_proj'),
                     export=True)
  config.algorithm = dict(
      name='fedavg',
      client_optimizer=optimizer('adamw', learning_rate=5e-4, weight_decay=0.0))
  return config
