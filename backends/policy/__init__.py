"""Where a policy's workers run and how they are reached: the ``Placement`` hierarchy
(``placement``), the Ray actors and ``PolicyRef`` (``actors``), a running job's record
(``live``), the Tinker service's handles on its models (``tinker_handles``). Imports
``backends.engines``, ``backends.models`` and ``backends.types``; never a service."""
