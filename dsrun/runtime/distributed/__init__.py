"""Process groups and who is where: `init_distributed` and `Topology`
(dist.py), the start-up rendezvous, which ranks share a node (nodes.py), the
ranks' agreement on model and config before the first collective, and the
names torch gives its collectives (torch_collectives.py)."""
