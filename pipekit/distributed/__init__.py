"""Process groups, ParallelDims -> DeviceMesh, data parallelism (FSDP2), gradient clipping."""
