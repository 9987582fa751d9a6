"""CPU adaptations of megatron-core (quarantined; see each patch module). Applied by megatron_rl.distributed."""
