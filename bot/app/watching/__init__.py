"""Watching: what holds GPUs now, GPU utilization, idle prompts and the watch on running runs."""
