"""MLflow: the runs flows log to, the model registry, references to registered models, figures, run history.

Runs opened and closed with the flow (:mod:`.mlflow_runs`), the compressed model as a registered pyfunc
model (:mod:`.model_registry`), ``models:/`` and ``s3://`` model references (:mod:`.remote_refs`), the
figures logged as run artifacts (:mod:`.plots`) and conversions read back from MLflow (:mod:`.run_history`).
"""
