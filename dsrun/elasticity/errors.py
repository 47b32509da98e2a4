"""The errors of elastic training, with DeepSpeed's names (`deepspeed.elasticity.config`)."""
from __future__ import annotations


class ElasticityError(Exception):
    """Base of every elasticity error: the elastic config cannot give a batch
    size for this job (a target runtime without elasticity, a world size the
    config does not allow, a bad `elasticity` section)."""


class ElasticityConfigError(ElasticityError):
    """The `elasticity` section is missing, disabled or invalid; the message
    names the key and what to set it to."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size of the job is not one of those the elastic config allows.

    Attributes:
        world_size: the world size asked for.
        valid_world_sizes: the sizes the config allows, ascending.
    """

    def __init__(self, message: str, world_size: int = 0, valid_world_sizes: tuple[int, ...] = ()):
        super().__init__(message)
        self.world_size = world_size
        self.valid_world_sizes = tuple(valid_world_sizes)

    def __reduce__(self):  # picklable with its attributes, e.g. to report a rank's failure
        return type(self), (str(self), self.world_size, self.valid_world_sizes)
