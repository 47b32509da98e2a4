"""Pipeline parallelism: the pipeline module (layers split into stages), the
schedules (lists of actions per rank) and the engine that runs them."""
