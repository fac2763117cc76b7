"""The Tinker API, self-hosted: the REST service the official ``tinker`` SDK talks to, with
flowrl's models behind it. One module each:

- ``server``: ``flowrl serve tinker`` (flags, keys, the process);
- ``routes``: the HTTP routes (thin: parse, call one verb, answer);
- ``service``: the state and verbs (sessions, models, futures, samplers, runs, checkpoints);
- ``types``: what the service and its models exchange, and the checks of a request's data;
- ``wire``: the SDK's protobuf messages;
- ``checkpoints``: where runs and checkpoints live in storage, and where base models come from;
- ``engine``: one training model (a LoRA adapter on a shared base, AdamW, samplers);
- ``handles``: the service's handles on its models, wherever their placement
  (``backends.placement``: this process, a session flow run's Ray actor, a shared worker) put
  them; ``actor``: that Ray actor.
"""
