"""Train a small Llama with tensor x pipeline parallelism: torchrun --nproc-per-node 4 examples/quickstart.py"""

import torch

import plait
from plait.models import Llama, LlamaConfig

ctx = plait.init(tp=2, pp=2, dp=1)  # reads torchrun's environment; Gloo on CPU, NCCL on GPUs
torch.manual_seed(0)  # every rank builds the same plain model; parallelize keeps only its shards
model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64))
pm = plait.parallelize(model, ctx, schedule="1f1b", microbatches=4, sequence_parallel=True)
opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
tokens = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
for step in range(5):
    loss = pm.train_step(tokens[:, :-1], tokens[:, 1:])  # same global mean loss on every rank
    opt.step()
    if ctx.rank == 0:
        print(f"step {step}: loss {loss:.4f}")
