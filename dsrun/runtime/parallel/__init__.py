"""Parallelism beyond data parallelism: the one parallelism mesh every process
group comes from, and the pipeline (later tensor, sequence and expert)
parallelism built on it."""
