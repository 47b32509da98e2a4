"""What a run tells its user: the rank-aware logger (logging.py), the
wall-clock timers (timers.py) and the one exit report per job
(exit_report.py). The monitor backends are in runtime/monitor/."""
