"""Pipeline parallelism: partitioning, point-to-point transport, the schedule executor and its traces."""
