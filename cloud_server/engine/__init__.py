"""The continuous-batching engine for the cloud's decoder layers (nano-vLLM's layout).

``sequence`` (one request's state), ``sampling_params``, ``kv_cache`` (block pool, block tables, prefix
cache), ``scheduler`` (what runs this step), ``model_runner`` (one forward pass over a flat batch),
``sampler`` and ``llm_engine`` (the step loop: schedule -> run -> postprocess).
"""
