"""An OpenAI-compatible endpoint on flowrl's models (``flowrl serve openai``): registered
versions, Tinker sampler checkpoints and the catalogue's base models, for the ``openai``
client and the agent frameworks built on it."""
