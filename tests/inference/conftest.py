"""Engine tests run the real vLLM engine (``.venv-engine``, made by ``bash scripts/setup_engine.sh``).

``scripts/test.sh`` makes the engine environment and sets ``MEGATRON_RL_REQUIRE_ENGINE=1``, so in CI (and with
the README's test command) a missing engine fails these tests instead of skipping them. A plain ``pytest``
without the engine skips them with the set-up command.
"""

# The engine fixtures (engine_py, engine_hf_model, engine_tied_model) live in tests/conftest.py: the main-job
# tests in tests/job use them too.
