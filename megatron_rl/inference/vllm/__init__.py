"""The vLLM fleet as the trainer sees it (``rollout.engine=vllm``): the files that run in the trainer's processes.

What the fleet can do (``CAPABILITIES``) is declared here, where the engine registry (``inference/registry.py``)
reads it without importing torch.
"""

from __future__ import annotations

from megatron_rl.inference.engine import EngineCapabilities

CAPABILITIES = EngineCapabilities(own_weights=True, concurrent=True, sleeps=True, partial_rollouts=True,
                                  agent_calls=True, own_nodes=True)
"""Its own weights in its own processes (synced in place, on-policy log-probs checked), generation on a rollout
thread while the trainer trains, vLLM sleep mode, partial rollouts, agent calls on rank 0's fleet, engines on nodes of their own."""
