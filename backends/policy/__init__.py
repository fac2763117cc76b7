"""Where a policy's workers run and how they are reached: the ``Placement`` hierarchy
(``placement``; ``place`` decides), the plain values a policy is built from (``resources``),
the driver's ``PolicyRef`` (``actors``), the Ray actors that hold the weights (``workers``), a
running job's record (``live``), the Tinker service's handles on its models
(``tinker_handles``). Imports ``backends.engines``, ``backends.models`` and
``backends.types``; never a service."""
