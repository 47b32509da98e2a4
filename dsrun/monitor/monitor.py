"""`deepspeed.monitor.monitor`: Monitor and MonitorMaster (dsrun/runtime/monitor/monitor.py)."""
from dsrun.runtime.monitor.monitor import Monitor, MonitorMaster  # noqa: F401 - this module is the re-export

__all__ = ["Monitor", "MonitorMaster"]
