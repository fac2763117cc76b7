"""Engines: the workers that hold weights and compute (samplers, trainers, the shared
base-model worker, the RL losses, a Tinker training model). Imports ``backends.models`` and
``backends.types``, never a placement or a service."""
