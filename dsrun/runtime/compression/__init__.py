"""Communication compression in the training path: the strategy that lets
1-bit optimizers own gradient communication (onebit_strategy.py)."""
from dsrun.runtime.compression.onebit_strategy import (CompressedCommStrategy, build_compression_strategy,
                                                       takes_over)

__all__ = ["CompressedCommStrategy", "build_compression_strategy", "takes_over"]
