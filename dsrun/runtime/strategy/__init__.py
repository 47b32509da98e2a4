"""The `GradientStrategy` interface every training mode implements, the
all-reduce (ZeRO stage 0) strategy (data_parallel.py) and the hook set the
strategies register on the model (hooks.py). ZeRO's stages live in
runtime/zero/ and the 1-bit strategy in runtime/compression/, at their
DeepSpeed paths."""
