"""Optimizers built from the ds_config (optimizers.py), DeepSpeed's
learning-rate schedules (lr_schedules.py) and the mixed-precision policy with
its loss scaler (precision.py)."""
