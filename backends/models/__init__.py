"""Model formats: what a model is on disk and in a chat, with no process of its own (chat
formats, model folders and URIs, the tiny offline model, VLMs, precision, exported adapters,
MLflow Models, Tinker checkpoint paths). Imports only ``backends.types``."""
