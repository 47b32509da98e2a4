"""Rank script: rendezvous through the launcher's environment alone and all-reduce rank+1 with gloo."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the environment
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"sum={value.item():g} world={dist.get_world_size()}")
dist.destroy_process_group()
