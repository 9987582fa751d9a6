"""The Megatron model stage (docs/DESIGN.md sections 3-5): builder (GPTModel + THD attention + RMSNorm), weights
(full <-> sharded state dicts), logprobs (vocab-parallel log-probs/entropy), policy (training wrapper)."""
