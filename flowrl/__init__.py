"""flowrl: reinforcement learning for LLM agents on Prefect, Ray, MLflow and S3.

Everything is installed under this one import root: ``flowrl.flows``, ``flowrl.tasks``,
``flowrl.agent_loop``, ``flowrl.environments``, ``flowrl.backends``, ``flowrl.infra`` (each kept
in its own top-level folder of the repository) and the command line, ``flowrl.cli``.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flowrl")
except PackageNotFoundError:  # running from a checkout that is not installed
    __version__ = "0+unknown"
