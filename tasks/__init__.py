"""lrkv_tasks: Prefect tasks (thin wrappers over lrkv_core), recipes, the artifact store, MLflow."""
