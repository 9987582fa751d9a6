"""What runs inside the vLLM engine's own processes (``.venv-engine``, where megatron-core is not installed):
the server's entry point (``vllm_serve.py``), the weight-sync receiver of every engine worker
(``vllm_worker.py``), and the engine zygote (``zygote.py``). Stdlib and vllm only; the trainer side imports their
shared constants and the wire format (``weight_sync.py`` reads ``vllm_worker.bucket_key``).
"""
