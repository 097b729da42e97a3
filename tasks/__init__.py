"""lrkv_tasks: Prefect tasks (thin wrappers over lrkv_core), the recipe schema, the artifact store and MLflow."""
