"""The error a bad dataset, task or data row raises: one message naming the file or task, the row and the fix.
Its own module so every data source (app/data.py, app/reasoning_gym_tasks.py) raises it without importing another."""


class DataError(ValueError):
    pass
