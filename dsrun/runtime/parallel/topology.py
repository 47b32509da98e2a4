"""DeepSpeed's process topology: global ranks laid out on a grid of named axes.

[Note: rank layout of a topology]
A topology names its axes outer to inner, e.g. ['pipe', 'data', 'model']
with dims [2, 2, 2], and numbers the ranks row-major: the last axis varies
fastest, so rank = ((pipe * D) + data) * M + model. Ranks that differ only
in the innermost axis are consecutive, hence usually on one node: DeepSpeed
puts the data axis inside the pipe axis so that gradient all-reduces stay
on fast intra-node links while the lighter pipeline sends cross nodes
(DeepSpeed, deepspeed/runtime/pipe/topology.py). The table for
PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2):

    rank  0 1 2 3 4 5 6 7
    pipe  0 0 0 0 1 1 1 1
    data  0 0 1 1 0 0 1 1
    model 0 1 0 1 0 1 0 1

Everything here is arithmetic on rank numbers; no process group is
created or needed (runtime/parallel/mesh.py builds the groups).
"""
from __future__ import annotations

import itertools
import keyword
import operator
from collections import namedtuple
from collections.abc import Iterable, Sequence


class ProcessTopology:
    """A grid of ranks with named axes (see [Note: rank layout of a topology]).

    Same methods and results as DeepSpeed's ProcessTopology. Coordinates are
    returned as `ProcessCoord` namedtuples whose fields are the axis names.

    Args:
        axes: axis names, outer to inner; distinct Python identifiers.
        dims: the number of ranks along each axis (>= 1), same length.

    Raises:
        ValueError: axes and dims differ in length, an axis name repeats or
            is not an identifier, or a dim is not a positive integer.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}; "
                             "give one dim per axis")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names {axes} repeat; name each axis once")
        for axis in axes:
            if not isinstance(axis, str) or not axis.isidentifier() or keyword.iskeyword(axis) \
                    or axis.startswith("_"):
                raise ValueError(f"ProcessTopology: axis name {axis!r} is not usable as a field name; "
                                 "use a plain identifier such as 'pipe' or 'data'")
        for axis, dim in zip(axes, dims):
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                raise ValueError(f"ProcessTopology: axis {axis!r} has dim {dim!r}; "
                                 "every dim must be an integer >= 1")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        # strides[i]: how far apart in rank two coordinates one step apart on axis i are
        self._strides = [1] * len(dims)
        for i in range(len(dims) - 2, -1, -1):
            self._strides[i] = self._strides[i + 1] * dims[i + 1]

    def _check_axes(self, names: Iterable[str], method: str) -> None:
        unknown = [name for name in names if name not in self.axes]
        if unknown:
            raise ValueError(f"{method}: unknown axis {unknown}; this topology's axes are {self.axes}")

    def _check_coord(self, axis: str, value, method: str) -> int:
        """`value` as an int coordinate on `axis` (any integer type)."""
        dim = self.get_dim(axis)
        try:
            index = operator.index(value)
        except TypeError:
            index = -1
        if not 0 <= index < dim:
            raise ValueError(f"{method}: {axis}={value!r} is outside axis {axis!r}, "
                             f"which has coordinates 0..{dim - 1}")
        return index

    def get_rank(self, **coord_kwargs: int) -> int:
        """The global rank at a full coordinate, e.g. get_rank(pipe=1, data=0).

        Raises:
            ValueError: an axis is missing (partial coordinates select several
                ranks: use filter_match), unknown, or out of range.
        """
        missing = [axis for axis in self.axes if axis not in coord_kwargs]
        if missing:
            raise ValueError(f"get_rank() needs a coordinate on every axis; {missing} missing "
                             "(for a slice of ranks use filter_match())")
        self._check_axes(coord_kwargs, "get_rank()")
        coord = {axis: self._check_coord(axis, value, "get_rank()") for axis, value in coord_kwargs.items()}
        return sum(coord[axis] * stride for axis, stride in zip(self.axes, self._strides))

    def get_coord(self, rank: int) -> tuple:
        """The ProcessCoord of global `rank` (fields named after the axes).

        Raises:
            ValueError: rank is not in 0..world_size()-1.
        """
        try:
            index = operator.index(rank)
        except TypeError:
            index = -1
        if not 0 <= index < self.world_size():
            raise ValueError(f"rank {rank!r} not found in topology of {self.world_size()} ranks")
        rank = index
        return self.ProcessCoord(*((rank // stride) % dim for stride, dim in zip(self._strides, self.dims)))

    def get_axis_names(self) -> list[str]:
        """The axis names, outer to inner."""
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: Iterable[str] = ("data", "pipe"),
                      inner_sep: str = "_", outer_sep: str = "-") -> str:
        """`rank`'s coordinate as text, e.g. 'model_01' (the axes not in
        `omit_axes`, each as name, inner_sep, two-digit coordinate, joined by
        outer_sep); DeepSpeed names pipeline checkpoint files with it."""
        coord = self.get_coord(rank)
        omit = frozenset(omit_axes)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in omit)

    def get_dim(self, axis: str) -> int:
        """The number of ranks along `axis`; 0 for an axis the topology lacks
        (DeepSpeed's answer, which lets hybrid code ask about any axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists of the communicator groups along `axis`: each list
        holds the ranks whose coordinates agree on every other axis, in order
        of their coordinate on `axis`; lists are ordered by the other axes'
        coordinates, outer to inner. [] for an axis the topology lacks.

        E.g. axes ['pipe', 'data', 'model'], dims [2, 2, 2], axis 'pipe':
        [[0, 4], [1, 5], [2, 6], [3, 7]].
        """
        if axis not in self.axes:
            return []
        i = self.axes.index(axis)
        others = [range(dim) for j, dim in enumerate(self.dims) if j != i]
        lists = []
        for rest in itertools.product(*others):
            base = sum(c * s for c, s in zip(rest, self._strides[:i] + self._strides[i + 1:]))
            lists.append([base + k * self._strides[i] for k in range(self.dims[i])])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks (ascending) whose coordinates equal every given one, e.g.
        filter_match(pipe=0, data=1) on dims [2, 2, 2] is [2, 3]. A value
        outside an axis matches nothing.

        Raises:
            ValueError: an axis name the topology lacks.
        """
        self._check_axes(filter_kwargs, "filter_match()")
        return [rank for rank in range(self.world_size())
                if all(getattr(self.get_coord(rank), axis) == value for axis, value in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks (ascending) whose coordinate on `axis` is `idx`.

        Raises:
            ValueError: an axis name the topology lacks.
        """
        self._check_axes([axis], "get_axis_list()")
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        """The number of ranks: the product of the dims."""
        return self._strides[0] * self.dims[0]

    @property
    def mapping(self) -> dict:
        """{ProcessCoord: global rank} for every rank, in rank order."""
        return {self.get_coord(rank): rank for rank in range(self.world_size())}

    def __str__(self) -> str:
        return str(self.mapping)

    def same_layout(self, other: "ProcessTopology") -> bool:
        """Whether `other` has the same axes and dims (so every rank has the
        same coordinate in both)."""
        return list(other.axes) == self.axes and list(other.dims) == self.dims


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism, axes ['pipe', 'data']: the data axis is
    inner, so a stage's data-parallel ranks are consecutive (one node)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism, axes ['pipe', 'data',
    'model'] -- note the argument order (pp, mp, dp) differs from the axis
    order, as in DeepSpeed."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def prime_factors(n: int) -> list[int]:
    """The prime factors of n >= 1, ascending with repeats (12 -> [2, 2, 3]).

    Raises:
        ValueError: n < 1.
    """
    if n < 1:
        raise ValueError(f"prime_factors({n}): n must be >= 1")
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def default_pipe_data_topology(world_size: int) -> PipeDataParallelTopology:
    """DeepSpeed's topology when a PipelineParallelGrid gets none: the prime
    factors of the world size, ascending, go alternately to the pipe and the
    data axis (8 ranks -> 2*2 = 4 stages x 2 data ranks; 6 -> 2 x 3)."""
    pipe = data = 1
    for i, p in enumerate(prime_factors(world_size)):
        if i % 2 == 0:
            pipe *= p
        else:
            data *= p
    return PipeDataParallelTopology(num_pp=pipe, num_dp=data)
