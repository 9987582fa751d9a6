"""Rollout generation: the engines that turn prompts into sampled responses and their log-probs.

Place in the data flow: before ``Trainer.train_step``; the main job (or a user's loop) asks an engine for
responses, builds a ``GeneratorOutput`` from them, trains, then hands the new weights back to the engine.

- ``engine.py``: the contract every engine follows (``RolloutEngine``, ``EngineCapabilities``, ``SamplingSpec``,
  ``Completion``, ``EngineError``); ``registry.py``: ``rollout.engine`` -> the factory that starts it
  (``register_engine``: the shipped engines, and a user's from ``rollout.engine_module``).
- ``config.py``: the ``rollout`` section; ``nodes.py``: which node starts which engine (multi-node jobs).
- ``builtin_engine.py``: the policy's own packed forward samples on every rank (no extra process).
- ``vllm/``: the vLLM fleet as the trainer sees it (``rollout.engine=vllm``): ``engine.py`` (``VLLMEngine``: start,
  generate, admit), ``membership.py`` and ``sync.py`` (its halves: who takes part in the weight sync, the sync
  itself), ``fleet.py`` + ``calls.py`` (rank 0's engines: health, restarts; routing, retries, agent calls),
  ``slot.py``, ``launcher.py``, ``server.py`` (one server over HTTP: start or attach, requests, kill),
  ``router.py`` (which engine gets which request, a pure function), ``weight_sync.py`` (the senders' side of the
  stream, in HF names and buckets), ``collective.py``.
- ``engine_process/``: what runs inside the engine's own processes, in ``.venv-engine`` (the only modules that
  import vllm): ``vllm_serve.py`` (the server's entry point: ``vllm serve`` + token + watchdog),
  ``vllm_worker.py`` (the weight-sync receiver in every engine worker), ``zygote.py`` (forks CPU servers from one
  process that has imported vLLM; its ``spawn`` half runs on the trainer).

This package imports nothing heavy at import time: ``engine_process/`` runs in the engine's environment, where
megatron-core is not installed.
"""
