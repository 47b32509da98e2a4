"""DeepSpeed's MoE layer: a gate, experts split over an expert-parallel
group, and the two all-to-alls between them (DeepSpeed-MoE, Rajbhandari et
al., ICML 2022; GShard, Lepikhin et al. 2020, section 2.2).

[Note: one MoE forward]
With S tokens on this rank, E experts over P expert-parallel ranks (L = E/P
each) and capacity C:

1. the gate assigns each token a slot of an expert (a route; routes.py);
2. the tokens are copied into [E, C, M] by their routes (zeros in empty
   slots);
3. all-to-all over the expert-parallel group: block p (experts p*L ..
   p*L+L-1) goes to rank p, which receives [P, L, C, M], the slots of its
   experts from every rank of the group;
4. each local expert runs on its [P, C, M] slice;
5. all-to-all back, so this rank again holds [E, C, M] for its own tokens;
6. each token's output is the combine-weighted sum of its routes' slots.

Expert i of rank p is global expert p*L + i, so the same model with P = 1
holds the same experts in the same order. Every rank exchanges E x C x M
elements each way whatever the routing, so a rank that routes no token to
an expert still takes part (no hang).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsrun.runtime.observability.logging import logger
from dsrun.runtime.parallel.expert.experts import Experts, all_to_all
from dsrun.runtime.parallel.expert.gating import TopKGate
from dsrun.runtime.parallel.expert.load import ExpertLoad
from dsrun.runtime.parallel.expert.routes import combine, dispatch
from dsrun.runtime.parallel.expert.groups import ExpertGroups, create_expert_groups, group_name
from dsrun.runtime.parallel.mesh import current


class MOELayer(torch.nn.Module):
    """The gate, this rank's experts and the exchange ([Note: one MoE
    forward]); DeepSpeed's `deepspeed.moe.sharded_moe.MOELayer(gate, experts,
    ep_group_name, ep_size, num_local_experts, use_tutel=False)`.

    Args:
        gate: a TopKGate over E = ep_size x num_local_experts experts.
        experts: this rank's `num_local_experts` experts (an Experts).
        ep_group_name: "ep_size_<ep_size>", the expert groups' name (every
            expert parameter carries it).
        ep_size: P, the expert-parallel degree.
        num_local_experts: L, experts per rank.
        use_tutel: DeepSpeed's Tutel dispatch; dsrun has none, so True logs
            a warning and dispatches as below (as DeepSpeed does when Tutel
            is not installed).

    The expert-parallel group is the mesh's (groups.py): `_set_ep_group`,
    which DeepSpeed's engine calls, accepts that group only.

    Attributes after a forward: l_aux (the gate's load-balancing loss),
    exp_counts ([E] int64, tokens per expert before drops, this rank);
    load: the training forwards' routing since the last step (load.py).

    Raises:
        ValueError: ep_group_name is not "ep_size_<ep_size>", or ep_size x
            num_local_experts is not the gate's number of experts.
    """

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        if ep_group_name != group_name(ep_size):
            raise ValueError(f"MOELayer: ep_group_name={ep_group_name!r} must be {group_name(ep_size)!r} for "
                             f"ep_size={ep_size} (the name dsrun's expert groups and parameters carry)")
        num_experts = gate.wg.weight.shape[0]
        if ep_size * num_local_experts != num_experts:
            raise ValueError(f"MOELayer: ep_size={ep_size} x num_local_experts={num_local_experts} must equal "
                             f"the gate's num_experts={num_experts}")
        if use_tutel:
            logger.warning("MOELayer: use_tutel=True, but dsrun has no Tutel dispatch; using its own all-to-all "
                        "(as DeepSpeed does when Tutel is not installed)")
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.ep_group = None
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.load = ExpertLoad(num_experts)  # the training forwards' routing (watch.py)

    def _set_ep_group(self, ep_group) -> None:
        """Record the expert-parallel group DeepSpeed's engine would hand the
        layer (and its gate).

        Raises:
            ValueError: `ep_group` holds other ranks than this rank's
                expert-parallel group on dsrun's mesh (pass
                `deepspeed.utils.groups._get_expert_parallel_group(ep_group_name)`),
                or the gate has a group already.
        """
        mine = self.groups().expert_parallel.ranks
        given = tuple(dist.get_process_group_ranks(ep_group)) if ep_group is not None else mine
        if given != mine:
            raise ValueError(f"MOELayer._set_ep_group: the group holds ranks {list(given)}, but this rank's "
                             f"expert-parallel group for ep_size={self.ep_size} is {list(mine)}; dsrun lays "
                             "expert groups out on its mesh: pass "
                             f"groups._get_expert_parallel_group({self.ep_group_name!r})")
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def groups(self) -> ExpertGroups:
        """This layer's expert groups on the current mesh (made on the first
        call by the members of this rank's groups, see groups.py)."""
        return create_expert_groups(self.ep_size, current())

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [..., M] -> [..., M], same dtype. Collective over the
        expert-parallel group (two all-to-alls; a MAX all-reduce too with
        drop_tokens=False)."""
        model_dim = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, model_dim)
        ep_group = self.groups().ep_group  # None before torch.distributed is initialised (one rank)
        routes = self.gate.route(tokens, used_token, ep_group=ep_group)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        # A training-mode forward (under no_grad too: reentrant activation checkpointing's first pass),
        # not checkpointing's recompute inside a backward (counted already).
        if self.training and torch._C._current_graph_task_id() == -1:
            self.load.record(routes.l_aux, routes.exp_counts, routes.kept_counts())
        slots, cap = routes.flat_slots(), routes.capacity
        dispatched = dispatch(tokens, slots, routes.num_experts * cap)  # [E*C, M]
        received = all_to_all(dispatched, ep_group)
        out = self.experts(received.reshape(self.ep_size, self.num_local_experts, cap, model_dim))
        returned = all_to_all(out.reshape(-1, model_dim), ep_group)
        return combine(returned, slots, routes.weights).reshape(hidden_states.shape)


class MoE(torch.nn.Module):
    """DeepSpeed's `deepspeed.moe.layer.MoE`.

    Args:
        hidden_size: M, the last dimension of the input.
        expert: the expert module ([..., M] -> [..., M]); this rank holds
            num_experts / ep_size deep copies of it.
        num_experts: E, experts in the layer over all expert-parallel ranks.
        ep_size: P, the expert-parallel degree (a divisor of the data-parallel
            size and of E); see groups.py [Note: expert groups].
        k: experts per token (1: Switch, 2: GShard, more: top-k).
        capacity_factor / eval_capacity_factor: capacity in training / eval
            ([Note: the gating outputs] in gating.py).
        min_capacity: fewest slots per expert.
        use_residual: PR-MoE (DeepSpeed-MoE section 4.1): `expert` itself is
            also kept as a dense MLP, and the output is
            softmax(coefficient(x))[0] x moe(x) + [1] x mlp(x).
        noisy_gate_policy: None, "Jitter" or "RSample" (training only).
        drop_tokens: False for dropless routing (capacity agreed over the
            expert-parallel group).
        use_rts: Random Token Selection for top-1 drops.
        top2_2nd_expert_sampling: Gumbel-noised second choice for k = 2.

    The expert groups are made on first use, on the mesh current then
    (`initialize`, or the first forward): a layer built before the job's
    mesh (a PipelineModule from num_stages) takes the pipeline's groups,
    and a layer on some stages only involves only their ranks (groups.py
    [Note: expert groups]).

    Raises:
        ValueError: num_experts not a multiple of ep_size; ep_size not a
            divisor of the data-parallel size; a bad gate argument.
    """

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1,
                 k: int = 1, capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4, use_residual: bool = False, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 \
                or not isinstance(num_experts, int) or num_experts < 1 or num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts!r} must be a positive multiple of "
                             f"ep_size={ep_size!r} (each expert-parallel rank holds num_experts / ep_size)")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = group_name(ep_size)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """hidden_states [..., M] -> (output [..., M], l_aux (scalar fp32),
        exp_counts ([E] int64 on CPU: tokens per expert on this rank before
        drops)). The caller adds l_aux (times its coefficient) to the loss."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + dense * mix[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
