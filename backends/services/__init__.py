"""The HTTP services on flowrl's models: the Tinker API (``tinker``) and the OpenAI-compatible
endpoint (``openai_api``), both on ``infra.serving``."""
