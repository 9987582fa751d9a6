"""Rollout generation: the engines that turn prompts into sampled responses and their log-probs.

Place in the data flow: before ``Trainer.train_step``; the main job (or a user's loop) asks an engine for
responses, builds a ``GeneratorOutput`` from them, trains, then hands the new weights back to the engine.

- ``engine.py``: the protocol every engine follows (``RolloutEngine``, ``SamplingSpec``, ``Completion``).
- ``builtin_engine.py``: the policy's own packed forward samples on every rank (no extra process).
- ``vllm_engine.py``: vLLM in its own process and Python environment (trainer side: lifecycle, RPC).
- ``vllm_server.py``: the engine process itself; the only module that imports vllm (runs in ``.venv-engine``).
- ``weight_sync.py``: streams the policy's weights, in HF names and buckets, into the running engine.

This package imports nothing heavy at import time: ``vllm_server.py`` runs in the engine's environment, where
megatron-core is not installed.
"""
