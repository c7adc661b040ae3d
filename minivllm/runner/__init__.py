"""The model runner: turns a scheduled step into tensors, runs the model, samples."""
