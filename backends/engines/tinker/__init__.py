"""A Tinker API training model (``model``: a LoRA adapter on a shared frozen base, AdamW,
sampler snapshots), the data it exchanges with the service (``types``), its Ray actor
(``actor``) and its sampling on vLLM (``vllm_sampling``)."""
