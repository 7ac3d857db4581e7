"""N-D parallelism for strategy fsdp: the device mesh (dp_replicate x dp_shard x tp) and tensor-parallel plans,
applied before FSDP2 shards the data-parallel dimensions (torchtitan's order)."""
