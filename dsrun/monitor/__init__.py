"""`deepspeed.monitor` for scripts: DeepSpeed's module path of the monitors.

The implementation is dsrun/runtime/monitor/ (an engine's monitors are
`engine.monitor`); `from dsrun.monitor.monitor import MonitorMaster` (or,
with the alias distribution, `from deepspeed.monitor.monitor import
MonitorMaster`) finds the same classes. dsrun's MonitorMaster is built from
a DsConfig and the rank (`MonitorMaster(load_config(cfg), rank)`), not from
DeepSpeed's monitor config object.
"""
