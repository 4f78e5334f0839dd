"""Worker side: the persistent input batch, the model runner, the worker."""
