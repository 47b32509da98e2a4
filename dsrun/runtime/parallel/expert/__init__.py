"""Mixture of Experts with expert parallelism (DeepSpeed-MoE): the gate
(gating.py), the experts of a rank (experts.py), the expert-parallel and
expert-data-parallel groups (groups.py), and the layer (layer.py)."""
