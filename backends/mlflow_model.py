"""Kept so that MLflow Models saved before ``backends/`` was cut into sub-packages still load:
their pickled ``python_model`` names ``flowrl.backends.mlflow_model.ChatPolicy``. The module is
``flowrl.backends.models.mlflow_model``."""

from flowrl.backends.models.mlflow_model import ChatPolicy

__all__ = ["ChatPolicy"]
