"""What holds and serves a model's weights, in four sub-packages by what each module is, and
the workers' data contracts (``types``). Each may import only those above it in this list:

- ``types``: the data contracts of the workers' verbs (``WorkerSpec``, ``SampleResult``, ...);
- ``models``: model formats, no process of their own: chat formats, model folders and URIs,
  the tiny offline model, vision-language models, precision, exported adapters, a policy as an
  MLflow Model, where Tinker checkpoints live;
- ``engines``: the workers that hold weights and compute: the HF sampler and torch trainer,
  DeepSpeed, vLLM, the shared base-model worker and its parking, episodes in a policy's own
  process, the RL losses (``algorithms``), a Tinker training model and its Ray actor;
- ``policy``: where a policy's workers run and how a job or a service reaches them: the
  ``Placement`` hierarchy, the Ray actors and ``PolicyRef``, a running job's live record, the
  Tinker service's handles on its models;
- ``services``: the HTTP services on those models: the Tinker API and the OpenAI-compatible
  endpoint.

A new loss goes in ``engines/algorithms.py``, a new engine in ``engines/``, a new way to place
workers in ``policy/placement.py``, a new service in ``services/``.
"""
