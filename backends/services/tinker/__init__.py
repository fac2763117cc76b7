"""The Tinker API, self-hosted: the REST service the official ``tinker`` SDK talks to, with
flowrl's models behind it. One module each:

- ``server``: ``flowrl serve tinker`` (flags, keys, the process);
- ``routes``: the HTTP routes (thin: parse, call one verb, answer);
- ``service``: the service, one part per resource, each owning its state: ``calls``
  (futures, the journal, retries' answers), ``registry`` (sessions and training models),
  ``training`` (the training verbs), ``sampling`` (samplers and ``sample``), ``checkpoints``
  (runs and checkpoints in storage, copies), ``exports`` (``export``: external weights and
  their signed downloads); ``state``: their records;
- ``search``: session search;
- ``wire``: the SDK's protobuf messages;
- ``journal``: what a restarted service carries on.

Its models are engines (``backends.engines.tinker``: the verbs on one LoRA model, the data it
exchanges, its Ray actor), placed and reached by ``backends.policy`` (``placement``,
``tinker_handles``: this process, a session flow run's Ray actor, a shared worker); where runs
and checkpoints live is ``backends.models.tinker_checkpoints``.
"""
