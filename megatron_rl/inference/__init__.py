"""Rollout generation: the engines that turn prompts into sampled responses and their log-probs.

Place in the data flow: before ``Trainer.train_step``; the main job (or a user's loop) asks an engine for
responses, builds a ``GeneratorOutput`` from them, trains, then hands the new weights back to the engine.

- ``engine.py``: the protocol every engine follows (``RolloutEngine``, ``SamplingSpec``, ``Completion``).
- ``builtin_engine.py``: the policy's own packed forward samples on every rank (no extra process).
- ``vllm_engine.py``: a fleet of ``vllm serve`` servers (trainer side: start, route, heal, sync; ``VLLMEngine``).
- ``server.py``: one server over HTTP (start or attach, requests, kill); ``router.py``: which engine gets which
  request (a pure function).
- ``vllm_serve.py`` (the server's entry point: ``vllm serve`` + token + watchdog) and ``vllm_worker.py`` (the
  weight-sync receiver in every engine worker): the only modules that import vllm (they run in ``.venv-engine``).
- ``weight_sync.py``: streams the policy's weights, in HF names and buckets, into every running engine.

This package imports nothing heavy at import time: ``vllm_serve.py`` and ``vllm_worker.py`` run in the engine's
environment, where megatron-core is not installed.
"""
