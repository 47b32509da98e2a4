"""Training metrics written to TensorBoard, CSV files and Weights & Biases.

DeepSpeed's `tensorboard`, `csv_monitor` and `wandb` config sections, its
`MonitorMaster.write_events([(name, value, step)])` and its event names
(`Train/Samples/train_loss`, ...). `engine.monitor` is the `MonitorMaster`
of a run; only global rank 0 writes. The events the engine writes by itself
at every optimizer step are listed in events.py.
"""
from dsrun.runtime.monitor.monitor import Monitor, MonitorMaster, MonitorUnavailableError

__all__ = ["Monitor", "MonitorMaster", "MonitorUnavailableError"]
