"""Tasks: rows from JSONL/Parquet files and built-in generated tasks, validated with file:row in errors."""

from turnrl.data.rows import DataError, Task, load_rows, task_from_row
from turnrl.data.tasks import TASKS, generate_task

__all__ = ["DataError", "Task", "load_rows", "task_from_row", "TASKS", "generate_task", "load_dataset"]


def load_dataset(path: str | None = None, task: str | None = None, size: int = 64, seed: int = 0,
                 options: dict | None = None, max_rows: int | None = None) -> list[Task]:
    if (path is None) == (task is None):
        raise DataError("give exactly one of a data file path or a built-in task name")
    tasks = load_rows(path) if path is not None else generate_task(task, size, seed, options or {})
    return tasks[:max_rows] if max_rows is not None else tasks
