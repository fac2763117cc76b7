"""The Tinker API, self-hosted: the REST service the official ``tinker`` SDK talks to, with
flowrl's models behind it. One module each:

- ``server``: ``flowrl serve tinker`` (flags, keys, the process);
- ``routes``: the HTTP routes (thin: parse, call one verb, answer);
- ``service``: the state and verbs (sessions, models, futures, samplers, runs, checkpoints);
- ``wire``: the SDK's protobuf messages;
- ``journal``: what a restarted service carries on.

Its models are engines (``backends.engines.tinker``: the verbs on one LoRA model, the data it
exchanges, its Ray actor), placed and reached by ``backends.policy`` (``placement``,
``tinker_handles``: this process, a session flow run's Ray actor, a shared worker); where runs
and checkpoints live is ``backends.models.tinker_checkpoints``.
"""
